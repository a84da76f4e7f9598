"""Experiment cells that resume and are committed as they finish: the runner behind the scripts that run a
pre-registered design cell by cell (scripts/recipe_sweep.py, scripts/sharing_pays.py).

A cell is one `sapo-experiment` command (one configuration, one seed). A cell whose copy is in the data dir
is done and skipped; any other runs (sapo-experiment resumes it from its checkpoints), and when it finishes
its run.json and each peer's metrics.jsonl are copied to the data dir, where `sapo-report` reads them and
git keeps them. So the work goes on across days and machines, and `--part i/n` shares it among n processes.
A cell that later cells start from (a veteran, whose adapter newcomers load) commits that checkpoint's weights
too (DEST/adapter), and counts as done only once they are there.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TypeVar

from node.ops.checkpoint import export_weights
from node.ops.metrics import read_records

T = TypeVar("T")


@dataclass(frozen=True)
class Cell:
    label: str  # for the log lines, e.g. "shares seed 3"
    command: list[str]
    run_dir: Path  # where sapo-experiment writes the run (EXP/<config>/seed<k>)
    dest: Path  # where its run.json and peer*/metrics.jsonl are committed
    adapter: Path | None = None  # a checkpoint of the run whose weights are committed too (DEST/adapter)

    @property
    def committed(self) -> bool:
        """Its run.json is in the data dir, and so are its weights where it commits them."""
        return (self.dest / "run.json").exists() and (self.adapter is None
                                                      or (self.dest / ADAPTER / "MANIFEST.json").is_file())


ADAPTER = "adapter"  # under a cell's data dir: the weights later cells start from


def unfinished(run_dir: Path) -> list[str]:
    """Why a cell's run is not a result yet (empty when it is): its run.json must say complete, and each of
    its peers must have every round and, where the cell evaluates, the evaluation after its last round
    (the one every summary reads)."""
    try:
        meta = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"no readable run.json ({exc})"]
    problems = [] if meta.get("status") == "complete" else [f"run.json says {meta.get('status')!r}"]
    rounds, peers = int(meta.get("rounds", 0)), int(meta.get("peers", 0))
    for p in range(peers):
        path = run_dir / f"peer{p}" / "metrics.jsonl"
        try:
            records = read_records(path)
        except (OSError, ValueError) as exc:
            problems.append(f"peer{p}: no readable metrics.jsonl ({exc})")
            continue
        last = {r.get("round"): r for r in records}  # a repeated round: its newest line counts, as in reports
        missing = sorted(set(range(rounds)) - set(last))
        if missing:
            problems.append(f"peer{p}: {len(missing)} of {rounds} rounds missing (from round {missing[0]})")
        elif meta.get("eval_every", 0) > 0 and "eval_accuracy" not in last[rounds - 1]:
            problems.append(f"peer{p}: no held-out evaluation after its last round")
    return problems


def copy_cell(run_dir: Path, dest: Path, adapter: Path | None = None) -> int:
    """Each peer's metrics.jsonl of a finished cell, the weights of `adapter` where given (without the
    optimizer), then its run.json (whose presence marks the cell committed, so it comes last); returns the
    number of peers copied."""
    dest.mkdir(parents=True, exist_ok=True)
    if adapter is not None:
        export_weights(adapter, dest / ADAPTER)
    peers = sorted(p for p in run_dir.glob("peer*") if (p / "metrics.jsonl").exists())
    for peer in peers:
        (dest / peer.name).mkdir(exist_ok=True)
        shutil.copy2(peer / "metrics.jsonl", dest / peer.name / "metrics.jsonl")
    shutil.copy2(run_dir / "run.json", dest / "run.json")
    return len(peers)


def part_of(items: Sequence[T], part: str) -> list[T]:
    """`i/n`: every n-th item (cell, or seed) starting at the i-th, so that n processes share the work."""
    index, parts = (int(x) for x in part.split("/"))
    if not 0 <= index < parts:
        raise ValueError(f"--part {part!r}: expected i/n with 0 <= i < n")
    return list(items)[index::parts]


def run_forwarding_stops(command: list[str], cwd: Path) -> int:
    """The cell's process, with this process's Ctrl-C or SIGTERM passed on to it and waited for: it stops
    at a safe point and checkpoints (seconds) instead of being killed, and never outlives this runner."""
    child = subprocess.Popen(command, cwd=cwd)

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_cells(cells: Sequence[Cell], cwd: Path, tag: str) -> int:
    """Run the cells not committed yet, in order, copying each as it finishes; stops at the first failure
    (returns its exit code; an interrupted cell resumes with the same command)."""
    for cell in cells:
        if cell.committed:
            print(f"[{tag}] {cell.label}: committed already", flush=True)
            continue
        if (cell.dest / "run.json").exists():
            print(f"[{tag}] {cell.label}: its metrics are committed but not its weights ({cell.dest / ADAPTER}), "
                  "which later cells start from: running it again (its metrics will be replaced)", flush=True)
        print(f"[{tag}] {cell.label}: running", flush=True)
        rc = run_forwarding_stops(cell.command, cwd)
        if rc != 0:
            print(f"[{tag}] {cell.label}: sapo-experiment exited {rc}; stopping", flush=True)
            return rc
        problems = unfinished(cell.run_dir)
        if problems:
            print(f"[{tag}] {cell.label}: not copied, the run is not a result: {'; '.join(problems)}", flush=True)
            return 1
        try:
            peers = copy_cell(cell.run_dir, cell.dest, cell.adapter)
        except (OSError, RuntimeError) as exc:  # CheckpointError: the checkpoint to commit is missing or corrupt
            print(f"[{tag}] {cell.label}: not copied: {exc}", flush=True)
            return 1
        print(f"[{tag}] {cell.label}: finished, {peers} peers copied to {cell.dest}", flush=True)
    return 0
