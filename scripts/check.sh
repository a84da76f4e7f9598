#!/usr/bin/env bash
# The fast checks, in seconds, before the 10-minute suite: lint (ruff), the type check (mypy on node/ and
# p2p/) and, with SAPO_FORMAT_CHECK=1, the formatting (ruff format --check; on once the tree has been
# formatted in one commit). Run from the project's virtual environment; scripts/test.sh runs it first.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[check] ruff check"
python -m ruff check --no-cache .
if [ "${SAPO_FORMAT_CHECK:-0}" = 1 ]; then
  echo "[check] ruff format --check"
  python -m ruff format --check --no-cache .
fi
echo "[check] mypy (node, p2p)"
python -m mypy
