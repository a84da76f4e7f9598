#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite offline (no model hub access).
set -euo pipefail
cd "$(dirname "$0")/.."
# the llama engine too: its tests run (SAPO_ENGINE=torch skips it); Gemma 3 270M for the two-family swarm test
SAPO_ENGINE="${SAPO_ENGINE:-llama}" SAPO_MODELS="${SAPO_MODELS:-gemma3-270m}" bash scripts/setup.sh
# shellcheck disable=SC1091
. "${SAPO_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -p no:cacheprovider --durations=15 "$@"
