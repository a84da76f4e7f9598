"""What a newcomer waits for: the README's quick start on this machine, from nothing or from a set-up checkout.

From nothing (default): clones this repository's HEAD into a temporary directory, with a fresh HOME (no model
cache) and no pip cache. With --set-up: this checkout as it is after `bash scripts/setup.sh` (its .venv, its
model cache), the run dirs in a temporary directory. Either way it runs `bash scripts/local_swarm.sh` with no
settings and stops it (SIGTERM: each peer checkpoints) once every peer has its held-out evaluation at round
--until. Prints, in seconds from the command's start: setup done, the bootstrap up, each peer's first round,
and for every evaluation round the time the last peer finished it and the five peers' mean held-out gain
over their starting weights; the first evaluation with a gain of at least --gain is the figure the README
quotes. Run it on an otherwise idle machine.

    python -m scripts.bench.quickstart --until 30 --out docs/data/quickstart-cpu
    python -m scripts.bench.quickstart --set-up --until 6 --out docs/data/quickstart-5min/run1
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
    ap.add_argument("--set-up", action="store_true", help="run in this checkout, set up already (its .venv, cache)")
    ap.add_argument("--gain", type=float, default=0.20, help="the mean held-out gain the first-gain figure is for")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sapo-quickstart-"))
    log_path = work / "quickstart.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "SAPO_VENV", "SAPO_RUN_ROOT")}
    if args.set_up:
        clone = REPO
        env.update(SAPO_RUN_ROOT=str(work / "runs"))
        run_root = work / "runs"
    else:
        clone, home = work / "repo", work / "home"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        home.mkdir()
        env.update(HOME=str(home), PIP_NO_CACHE_DIR="1")
        run_root = clone / "runs" / "local-swarm"
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
    peers = [run_root / f"peer{i}" for i in range(args.peers)]
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
    result["by_evaluation"] = by_evaluation(peers, t0)
    result["first_gain"] = first_gain(result["by_evaluation"], args.gain)
    print(json.dumps(result, indent=1))
    if args.out:
        out = Path(args.out)
        for i, peer in enumerate(peers):
            (out / f"peer{i}").mkdir(parents=True, exist_ok=True)
            shutil.copy2(peer / "metrics.jsonl", out / f"peer{i}" / "metrics.jsonl")
        (out / "measure.json").write_text(json.dumps(result, indent=1) + "\n")
    for row in result["by_evaluation"]:
        done = (
            f"{row['last_done_s']:7.1f} s after the command" if row["last_done_s"] is not None else "(before round 0)"
        )
        print(
            f"evaluation at round {row['round']!s:>5}: last peer done {done}, mean held-out {row['held_out']:.3f}, "
            f"gain over the start {row['gain']:+.3f} ({row['peers']} peers)"
        )
    fg = result["first_gain"]
    print(
        f"first evaluation with a mean gain >= {args.gain:+.2f}: "
        + (f"round {fg['round']}, {fg['last_done_s']:.0f} s after the command" if fg else "none")
    )
    print(f"log: {log_path}; the run dirs stay in {work} (remove it when done)")
    return 0 if marks.get("stop") else 1


def by_evaluation(peers: list[Path], t0: float) -> list[dict]:
    """Per evaluation round that every peer reached: when the last peer had it (seconds after the command)
    and the peers' mean held-out accuracy and mean gain over their own starting weights."""
    per_peer = [{r["round"]: r for r in records(peer / "metrics.jsonl")} for peer in peers]
    start = [recs.get(0, {}).get("start_accuracy") for recs in per_peer]
    if not per_peer or None in start:
        return []
    rounds = sorted(set.intersection(*({k for k, r in recs.items() if "eval_accuracy" in r} for recs in per_peer)))
    rows = [
        {"round": "start", "last_done_s": None, "held_out": sum(start) / len(start), "gain": 0.0, "peers": len(start)}
    ]
    for r in rounds:
        acc = [recs[r]["eval_accuracy"] for recs in per_peer]
        rows.append(
            {
                "round": r,
                "last_done_s": round(max(recs[r]["t_end"] for recs in per_peer) - t0, 1),
                "held_out": sum(acc) / len(acc),
                "gain": sum(a - s for a, s in zip(acc, start)) / len(acc),
                "peers": len(acc),
            }
        )
    return rows


def first_gain(rows: list[dict], gain: float) -> dict | None:
    """The first evaluation whose mean gain over the start reaches `gain`."""
    return next((r for r in rows if r["round"] != "start" and r["gain"] >= gain), None)


if __name__ == "__main__":
    raise SystemExit(main())
