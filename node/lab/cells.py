"""Experiment cells that resume and are committed as they finish: the runner behind the scripts that run a
pre-registered design cell by cell (scripts/recipe_sweep.py, scripts/sharing_pays.py).

A cell is one `sapo-experiment` command (one configuration, one seed). A cell whose copy is in the data dir
is done and skipped; any other runs (sapo-experiment resumes it from its checkpoints), and when it finishes
its run.json and each peer's metrics.jsonl are copied to the data dir, where `sapo-report` reads them and
git keeps them. So the work goes on across days and machines, and `--part i/n` shares it among n processes.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Cell:
    label: str  # for the log lines, e.g. "shares seed 3"
    command: list[str]
    run_dir: Path  # where sapo-experiment writes the run (EXP/<config>/seed<k>)
    dest: Path  # where its run.json and peer*/metrics.jsonl are committed


def copy_cell(run_dir: Path, dest: Path) -> int:
    """run.json and each peer's metrics.jsonl of a finished cell; returns the number of peers copied."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(run_dir / "run.json", dest / "run.json")
    peers = sorted(p for p in run_dir.glob("peer*") if (p / "metrics.jsonl").exists())
    for peer in peers:
        (dest / peer.name).mkdir(exist_ok=True)
        shutil.copy2(peer / "metrics.jsonl", dest / peer.name / "metrics.jsonl")
    return len(peers)


def part_of(items: Sequence[T], part: str) -> list[T]:
    """`i/n`: every n-th item (cell, or seed) starting at the i-th, so that n processes share the work."""
    index, parts = (int(x) for x in part.split("/"))
    if not 0 <= index < parts:
        raise ValueError(f"--part {part!r}: expected i/n with 0 <= i < n")
    return list(items)[index::parts]


def run_cells(cells: Sequence[Cell], cwd: Path, tag: str) -> int:
    """Run the cells not committed yet, in order, copying each as it finishes; stops at the first failure
    (returns its exit code; an interrupted cell resumes with the same command)."""
    for cell in cells:
        if (cell.dest / "run.json").exists():
            print(f"[{tag}] {cell.label}: committed already", flush=True)
            continue
        print(f"[{tag}] {cell.label}: running", flush=True)
        rc = subprocess.call(cell.command, cwd=cwd)
        if rc != 0:
            print(f"[{tag}] {cell.label}: sapo-experiment exited {rc}; stopping", flush=True)
            return rc
        peers = copy_cell(cell.run_dir, cell.dest)
        print(f"[{tag}] {cell.label}: finished, {peers} peers copied to {cell.dest}", flush=True)
    return 0
