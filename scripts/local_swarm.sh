#!/usr/bin/env bash
# Sets up the environment, then runs a local swarm: one bootstrap peer and SAPO_PEERS (default 5)
# sapo-node peers on this machine, sharing its GPU if there is one (else the CPU), with a combined
# progress view. Ctrl-C stops everything; every peer checkpoints first. Run it again to resume.
#
# Settings (environment): SAPO_PEERS=5 SAPO_MODEL=default SAPO_TASKS=cpu-easy (CPU) / paper (GPU)
#   SAPO_LOCAL_ROUNDS=100 SAPO_NUM_LOCAL=2 SAPO_NUM_EXTERNAL=2 SAPO_GENERATIONS=6 SAPO_RUN_ROOT=runs/local-swarm
#   SAPO_STATUS_BASE_PORT=0 (e.g. 8100: peer i serves its dashboard on 8100+i)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${SAPO_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

PEERS="${SAPO_PEERS:-5}"
MODEL="${SAPO_MODEL:-default}"
ROOT="${SAPO_RUN_ROOT:-runs/local-swarm}"
ROUNDS="${SAPO_LOCAL_ROUNDS:-100}"
HAS_GPU=$(python -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$HAS_GPU" = 1 ]; then DEFAULT_TASKS=paper; else DEFAULT_TASKS=cpu-easy; fi
TASKS="${SAPO_TASKS:-$DEFAULT_TASKS}"
CORES=$(nproc)
THREADS=$(( CORES / PEERS )); [ "$THREADS" -ge 1 ] || THREADS=1
STATUS_BASE="${SAPO_STATUS_BASE_PORT:-0}"
# Activation memory grows with the micro-batch; on a shared CPU keep it small so 5 peers fit in RAM.
if [ "$HAS_GPU" = 1 ]; then MICRO=8; else MICRO=2; fi
MICRO="${SAPO_MICRO_BATCH_SIZE:-$MICRO}"

# Refuse to start when the peers would not fit in memory (GPU memory if there is a GPU, else RAM).
python -m node.ops.resources --model "$MODEL" --peers "$PEERS"

mkdir -p "$ROOT/bootstrap"
rm -f "$ROOT/bootstrap/maddrs.txt"
PIDS=()
BOOT_PID=""
cleanup() {
  trap - INT TERM EXIT
  echo
  echo "[local-swarm] stopping: each peer finishes its round and checkpoints..."
  for pid in "${PIDS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "$PROGRESS_PID" ] && kill "$PROGRESS_PID" 2>/dev/null || true
  [ -n "$BOOT_PID" ] && kill -TERM "$BOOT_PID" 2>/dev/null && wait "$BOOT_PID" 2>/dev/null || true
  echo "[local-swarm] stopped. Run dirs: $ROOT/peer*/ (metrics.jsonl, node.log). Run again to resume."
}
PROGRESS_PID=""
trap cleanup INT TERM EXIT

sapo-bootstrap --identity-dir "$ROOT/bootstrap" --host-maddrs /ip4/127.0.0.1/tcp/0 \
  --maddrs-file "$ROOT/bootstrap/maddrs.txt" >"$ROOT/bootstrap/bootstrap.log" 2>&1 &
BOOT_PID=$!
for _ in $(seq 1 300); do
  [ -s "$ROOT/bootstrap/maddrs.txt" ] && break
  kill -0 "$BOOT_PID" 2>/dev/null || { echo "bootstrap failed:"; cat "$ROOT/bootstrap/bootstrap.log"; exit 1; }
  sleep 0.2
done
mapfile -t MADDRS < "$ROOT/bootstrap/maddrs.txt"
echo "[local-swarm] bootstrap at ${MADDRS[0]}"
echo "[local-swarm] $PEERS peers | model $MODEL | tasks $TASKS | $THREADS CPU thread(s) each | run dirs $ROOT/peer*"

RUN_DIRS=()
for i in $(seq 0 $((PEERS - 1))); do
  dir="$ROOT/peer$i"
  RUN_DIRS+=("$dir")
  mkdir -p "$dir"
  extra=()
  [ -f "$dir/metrics.jsonl" ] && extra+=(--resume)
  [ "$STATUS_BASE" -gt 0 ] && extra+=(--status-port $((STATUS_BASE + i)))
  sapo-node --model "$MODEL" --tasks "$TASKS" --rounds "$ROUNDS" --seed "$i" --name "peer$i" \
    --num-local "${SAPO_NUM_LOCAL:-2}" --num-external "${SAPO_NUM_EXTERNAL:-2}" \
    --generations "${SAPO_GENERATIONS:-6}" --threads "$THREADS" --micro-batch-size "$MICRO" --run-dir "$dir" \
    --host-maddrs /ip4/127.0.0.1/tcp/0 --peers "${MADDRS[@]}" "${extra[@]}" \
    >>"$dir/console.log" 2>&1 &
  PIDS+=($!)
done

python -m node.ops.progress "${RUN_DIRS[@]}" &
PROGRESS_PID=$!
for pid in "${PIDS[@]}"; do wait "$pid" || true; done
echo "[local-swarm] all peers finished $ROUNDS rounds. Report: sapo-report $ROOT"
