#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite offline (no model hub access).
set -euo pipefail
cd "$(dirname "$0")/.."
SAPO_ENGINE="${SAPO_ENGINE:-llama}" bash scripts/setup.sh  # the llama engine too: its tests run (SAPO_ENGINE=torch skips it)
# shellcheck disable=SC1091
. "${SAPO_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -rs -p no:cacheprovider --durations=15 "$@"
