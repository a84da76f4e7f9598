"""What stopping and checkpointing cost, for docs/BENCHMARKS.md (re-measure with this script).

1. Checkpoint cost: save (write + fsync + sha256 manifest) and load+verify of a full checkpoint of the
   model with a populated Adam state (as after any training round), and its size on disk.
2. Stop latency: a real `sapo-node` (silo) is started; after --after-rounds completed rounds, once its
   status says it is in --phase of the next round, it gets SIGINT; the time until the process has
   exited (round abandoned, last completed round checkpointed, swarm and worker closed) is printed.

    python -m scripts.bench.stop --model default --tasks cpu-easy
    python -m scripts.bench.stop --model tiny-random --tasks smoke --skip-checkpoint   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def checkpoint_cost(model_name: str, work: Path, repeats: int) -> None:
    import torch

    from node.learn.model_io import load_model
    from node.learn.trainer import TrainConfig, Trainer
    from node.ops.checkpoint import CheckpointStore

    model, tok = load_model(model_name, torch.device("cpu"))
    trainer = Trainer(model, tok.pad_token_id, TrainConfig())
    for p in model.parameters():  # one optimizer step on zero gradients: Adam's moments exist, as after training
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    store = CheckpointStore(work, keep=2)
    saves, loads = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        path = store.save(r, model.state_dict(), trainer.optimizer.state_dict(), {"next_round": r + 1})
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.load_latest()
        loads.append(time.perf_counter() - t0)
    print(
        f"checkpoint  model={model_name} params={params / 1e6:.1f}M size={dir_mb(path):.0f} MB "
        f"save={min(saves):.2f}-{max(saves):.2f} s load+verify={min(loads):.2f}-{max(loads):.2f} s "
        f"({repeats} saves)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def stop_latency(args, work: Path) -> None:
    run_dir, port = work / "run", free_port()
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
        "--model",
        args.model,
        "--tasks",
        args.tasks,
        "--rounds",
        "1000",
        "--run-dir",
        str(run_dir),
        "--status-port",
        str(port),
        "--checkpoint-every",
        "1000",
        "--threads",
        str(args.threads),
        *args.node_arg,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    t_start = time.monotonic()
    with open(work / "node.out", "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            snap = status(port)
            if proc.poll() is not None:
                sys.exit(f"node exited early ({proc.returncode}); see {work / 'node.out'}")
            # at least --after-rounds: a tiny model's phase lasts milliseconds, and a poll on a loaded machine
            # that missed round N's could otherwise wait for the last of --rounds and report an early exit
            if snap and snap["round"] >= args.after_rounds and snap["phase"] == args.phase:
                signalled_in = snap["round"]
                break
            time.sleep(0.05)
        t_ready = time.monotonic()
        proc.send_signal(signal.SIGINT)
        t_sig = time.monotonic()
        rc = proc.wait(600)
        t_exit = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (run_dir / "node.log").read_text()
    written = re.search(r"checkpoint (round-\d+) written in ([\d.]+)s", log)
    abandoned = re.search(r"round (\d+) abandoned", log)
    print(
        f"stop        model={args.model} threads={args.threads or 'all'} signal in round {signalled_in} "
        f"phase {args.phase} (after {t_ready - t_start:.0f} s): exit code {rc} after {t_exit - t_sig:.1f} s; "
        f"{'round ' + abandoned.group(1) + ' abandoned' if abandoned else 'no round abandoned'}; "
        f"{written.group(1) + ' written in ' + written.group(2) + ' s' if written else 'no checkpoint written'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", default="cpu-easy")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads of the node (0 = all cores)")
    ap.add_argument("--after-rounds", type=int, default=1, help="completed rounds before the signal (at least)")
    ap.add_argument("--phase", default="generate", choices=("generate", "train"), help="phase the signal lands in")
    ap.add_argument("--repeats", type=int, default=3, help="checkpoint saves to time")
    ap.add_argument("--skip-checkpoint", action="store_true")
    ap.add_argument("--skip-stop", action="store_true")
    ap.add_argument("--node-arg", action="append", default=[], help="extra sapo-node flag (repeatable)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-stop-"))
    try:
        if not args.skip_checkpoint:
            checkpoint_cost(args.model, work / "ckpt", args.repeats)
        if not args.skip_stop:
            stop_latency(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
