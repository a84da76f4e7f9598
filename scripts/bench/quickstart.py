"""What a newcomer waits for: the README's quick start on this machine, from nothing.

Clones this repository's HEAD into a temporary directory, with a fresh HOME (no model cache) and no pip
cache, runs `bash scripts/local_swarm.sh` with no settings, and stops it (SIGTERM: each peer checkpoints)
once every peer has its held-out evaluation at round --until. Prints, in seconds from the command's start:
setup done, the bootstrap up, each peer's first round, each peer's evaluation at --until; and each peer's
held-out (and unseen-set) accuracy at every evaluation. Run it on an otherwise idle machine.

    python -m scripts.bench.quickstart --until 30 --out docs/data/quickstart-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from node.ops.metrics import read_records

REPO = Path(__file__).resolve().parents[2]


def records(path: Path) -> list[dict]:
    try:
        return read_records(path, partial_ok=True)  # a live file: its last line may be half written
    except OSError:
        return []  # not written yet


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--until", type=int, default=30, help="stop once every peer has its evaluation at this round")
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--out", default="", help="copy each peer's metrics.jsonl and the figures (measure.json) here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sapo-quickstart-"))
    clone, home, log_path = work / "repo", work / "home", work / "quickstart.log"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "SAPO_VENV")}
    env.update(HOME=str(home), PIP_NO_CACHE_DIR="1")
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", "scripts/local_swarm.sh"],
            cwd=clone,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    marks: dict[str, float] = {}
    peers = [clone / "runs" / "local-swarm" / f"peer{i}" for i in range(args.peers)]
    while proc.poll() is None:
        text = log_path.read_text(errors="replace")
        for key, needle in (("setup_done", "[setup] ready"), ("bootstrap", "bootstrap at")):
            if key not in marks and needle in text:
                marks[key] = time.time() - t0
        done = 0
        for i, peer in enumerate(peers):
            recs = records(peer / "metrics.jsonl")
            if recs:
                marks.setdefault(f"first_round_peer{i}", time.time() - t0)
            if any(r.get("round") == args.until and "eval_accuracy" in r for r in recs):
                marks.setdefault(f"round{args.until}_peer{i}", time.time() - t0)
                done += 1
        if done == len(peers) and "stop" not in marks:
            marks["stop"] = time.time() - t0
            os.kill(proc.pid, signal.SIGTERM)  # the script asks each peer to stop and checkpoint
        time.sleep(5)
    result: dict = {k: round(v, 1) for k, v in marks.items()}
    result["exit_code"] = proc.returncode
    result["evaluations"] = {
        f"peer{i}": [
            {
                "round": r["round"],
                "held_out": r["eval_accuracy"],
                "unseen": r.get("eval_unseen_accuracy"),
                "baseline": r.get("eval_baseline"),
                "unseen_baseline": r.get("eval_unseen_baseline"),
                "evaluator": r.get("eval_engine", "torch"),
            }
            for r in records(peer / "metrics.jsonl")
            if "eval_accuracy" in r
        ]
        for i, peer in enumerate(peers)
    }
    print(json.dumps(result, indent=1))
    if args.out:
        out = Path(args.out)
        for i, peer in enumerate(peers):
            (out / f"peer{i}").mkdir(parents=True, exist_ok=True)
            shutil.copy2(peer / "metrics.jsonl", out / f"peer{i}" / "metrics.jsonl")
        (out / "measure.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"log: {log_path}; the clone stays in {work} (remove it when done)")
    return 0 if marks.get("stop") else 1


if __name__ == "__main__":
    raise SystemExit(main())
