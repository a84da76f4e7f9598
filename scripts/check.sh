#!/usr/bin/env bash
# The fast checks, in seconds, before the 10-minute suite: lint (ruff check), the formatting (ruff format
# --check; `ruff format .` fixes it) and the type check (mypy on node/ and p2p/). Run from the project's
# virtual environment; scripts/test.sh runs it first.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[check] ruff check"
python -m ruff check --no-cache .
echo "[check] ruff format --check"
python -m ruff format --check --no-cache .
echo "[check] mypy (node, p2p)"
python -m mypy
