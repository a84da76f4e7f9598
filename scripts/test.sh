#!/usr/bin/env bash
# Sets up the environment, runs the fast checks (scripts/check.sh) and the whole test suite offline (no model
# hub access). Arguments go to pytest: `bash scripts/test.sh tests/learn -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
# the llama engine (a wheel): its tests run (SAPO_ENGINE=torch: they skip); Gemma 3 270M for the two-family test
SAPO_MODELS="${SAPO_MODELS:-gemma3-270m}" bash scripts/setup.sh
export SAPO_ENGINE="${SAPO_ENGINE:-llama}"  # the engine tests read it
# shellcheck disable=SC1091
. "${SAPO_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# lint and type check first: a style error costs seconds, not the suite (SAPO_SKIP_CHECKS=1: straight to pytest)
[ "${SAPO_SKIP_CHECKS:-0}" = 1 ] || bash scripts/check.sh
# two workers (SAPO_TEST_WORKERS=1: one): most end-to-end tests wait on subprocesses and the network, so two
# keep a 2-core machine busy; the slow tests go first (tests/conftest.py) and an idle worker steals work
exec python -m pytest -q -rs -p no:cacheprovider -n "${SAPO_TEST_WORKERS:-2}" --dist worksteal --durations=30 "$@"
