#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite offline (no model hub access).
set -euo pipefail
cd "$(dirname "$0")/.."
# the llama engine (a wheel): its tests run (SAPO_ENGINE=torch: they skip); Gemma 3 270M for the two-family test
SAPO_MODELS="${SAPO_MODELS:-gemma3-270m}" bash scripts/setup.sh
export SAPO_ENGINE="${SAPO_ENGINE:-llama}"  # the engine tests read it
# shellcheck disable=SC1091
. "${SAPO_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -rs -p no:cacheprovider --durations=15 "$@"
