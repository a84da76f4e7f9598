#!/usr/bin/env bash
# Runs the given tests N times in a row with a CPU-heavy process on every core beside them, and prints how
# many runs passed: the check for tests whose bounds read wall time (the bar set for them: "passes 5 runs in a row with
# a CPU-heavy process beside it"). Not part of the suite: it takes minutes.
#
#   bash scripts/flake_check.sh 5 tests/e2e/test_swarm_dht.py::test_killed_peer_does_not_stall_others_and_resumes_with_same_address
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:?usage: flake_check.sh RUNS TEST...}"
shift
# shellcheck disable=SC1091
. "${SAPO_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
hogs=()
for _ in $(seq "$(nproc)"); do
  python -c "while True: pass" &
  hogs+=("$!")
done
trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
echo "[flake-check] $(nproc) busy loops beside the tests (pids ${hogs[*]})"
for test in "$@"; do
  passed=0
  for i in $(seq "$runs"); do
    start=$(date +%s)
    if python -m pytest -q -p no:cacheprovider "$test" >"/tmp/flake-check-$i.log" 2>&1; then
      passed=$((passed + 1)); verdict=passed
    else
      verdict="FAILED (log: /tmp/flake-check-$i.log)"; cp "/tmp/flake-check-$i.log" "/tmp/flake-check-failed-$i.log"
    fi
    echo "[flake-check] $test run $i: $verdict in $(( $(date +%s) - start ))s"
  done
  echo "[flake-check] $test: $passed of $runs passed"
done
