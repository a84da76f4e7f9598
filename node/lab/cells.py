"""Experiment cells that resume and are committed as they finish: the runner behind the scripts that run a
pre-registered design cell by cell (scripts/research/recipe_sweep.py, scripts/research/sharing_pays.py).

A cell is one `sapo-experiment` command (one configuration, one seed). A cell whose copy is in the data dir
is done and skipped; any other runs (sapo-experiment resumes it from its checkpoints), and when it finishes
its run.json and each peer's metrics.jsonl are copied to the data dir, where `sapo-report` reads them and
git keeps them. So the work goes on across days and machines, and `--part i/n` shares it among n processes.
A cell that later cells start from (a veteran, whose adapter newcomers load) also keeps that checkpoint's weights
beside its metrics (DEST/adapter, which git ignores: weights stay out of the repository), and counts as done only
where they are there: on a machine without them it runs again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

from node.ops.checkpoint import export_weights
from node.ops.metrics import read_records

T = TypeVar("T")


@dataclass(frozen=True)
class Cell:
    label: str  # for the log lines, e.g. "shares seed 3"
    command: list[str]
    run_dir: Path  # where sapo-experiment writes the run (EXP/<config>/seed<k>)
    dest: Path  # where its run.json and peer*/metrics.jsonl are committed
    adapter: Path | None = None  # a checkpoint of the run whose weights are kept too (DEST/adapter)
    # what else its run.json must say to count as a result (a design's pinned engines): the problems, or none
    check: Callable[[dict], list[str]] | None = None

    @property
    def committed(self) -> bool:
        """Its run.json is in the data dir, and so are its weights where it keeps them (on this machine)."""
        return (self.dest / "run.json").exists() and (
            self.adapter is None or (self.dest / ADAPTER / "MANIFEST.json").is_file()
        )


ADAPTER = "adapter"  # under a cell's data dir: the weights later cells start from


def unfinished(run_dir: Path, check: Callable[[dict], list[str]] | None = None) -> list[str]:
    """Why a cell's run is not a result yet (empty when it is): its run.json must say complete (and pass
    `check`, where the cell has one), and each of its peers must have every round and, where the cell
    evaluates, the evaluation after its last round (the one every summary reads)."""
    try:
        meta = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"no readable run.json ({exc})"]
    problems = [] if meta.get("status") == "complete" else [f"run.json says {meta.get('status')!r}"]
    problems += check(meta) if check is not None else []
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


def clock_time(text: str, now: datetime | None = None) -> float:
    """`HH:MM` (local time; tomorrow when today's has passed) or an ISO date-time -> epoch seconds."""
    now = now or datetime.now()
    try:
        hours, minutes = (int(x) for x in text.split(":"))
        at = now.replace(hour=hours, minute=minutes, second=0, microsecond=0)
        return (at if at > now else at + timedelta(days=1)).timestamp()
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"{text!r}: expected HH:MM or an ISO date-time, e.g. 22:15 or 2026-11-27T09:30") from None


def wall_seconds(data_dir: Path) -> float | None:
    """How long a committed cell ran, first round's start to last round's end over its peers (None if unknown)."""
    starts, ends = [], []
    for path in data_dir.glob("peer*/metrics.jsonl"):
        try:
            records = read_records(path)
        except (OSError, ValueError):
            continue
        starts += [r["t_start"] for r in records if isinstance(r.get("t_start"), (int, float))]
        ends += [r["t_end"] for r in records if isinstance(r.get("t_end"), (int, float))]
    return max(ends) - min(starts) if starts and ends else None


def done_fraction(run_dir: Path) -> float:
    """The share of a cell's rounds its slowest peer has finished in its run dir (0 when it has not started)."""
    try:
        meta = json.loads((run_dir / "run.json").read_text())
        rounds, peers = int(meta["rounds"]), int(meta["peers"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    done = []
    for p in range(peers):
        try:
            done.append(
                len({r.get("round") for r in read_records(run_dir / f"peer{p}" / "metrics.jsonl", partial_ok=True)})
            )
        except (OSError, ValueError):
            done.append(0)
    return min(done, default=0) / rounds if rounds > 0 else 0.0


@dataclass
class Deadline:
    """No cell starts that would not finish by `at` (epoch seconds): a machine whose run dirs do not outlive the
    session loses a cell it cut off. A cell's length: `cell_s` where given, else the longest this runner has
    measured for a cell of the same configuration (the same data dir parent), else the median of the committed
    ones' (measured on whichever machine ran them), else unknown (it starts)."""

    at: float
    cell_s: float | None = None
    measured: dict[Path, float] = field(default_factory=dict)

    def estimate(self, cell: Cell) -> tuple[float | None, str]:
        if self.cell_s is not None:
            return self.cell_s, "as given"
        if cell.dest.parent in self.measured:
            return self.measured[cell.dest.parent], "measured here"
        walls = [
            w
            for d in cell.dest.parent.glob("seed*")
            if (d / "run.json").exists()
            for w in [wall_seconds(d)]
            if w is not None
        ]
        return (statistics.median(walls), f"median of {len(walls)} committed") if walls else (None, "unknown")

    def measure(self, cell: Cell, seconds: float) -> None:
        self.measured[cell.dest.parent] = max(seconds, self.measured.get(cell.dest.parent, 0.0))


def cell_status(cells: Sequence[Cell]) -> str:
    """One line per cell (committed, part done in its run dir here, or to do) and a total: where an experiment
    that runs across days and machines stands."""
    lines, committed = [], 0
    for cell in cells:
        if cell.committed:
            committed += 1
            state = "committed"
        elif (done := done_fraction(cell.run_dir)) > 0 or (cell.run_dir / "run.json").exists():
            state = f"{done:.0%} of its rounds done in {cell.run_dir} (running, or resumes here)"
        else:
            state = "to do" + (
                " (its weights are not on this machine: runs again)" if (cell.dest / "run.json").exists() else ""
            )
        lines.append(f"{cell.label}: {state}")
    total = f"{committed} of {len(cells)} cells committed"
    left = cell_time_left(cells)
    if left is not None and committed < len(cells):
        total += f"; about {left / 3600:.1f} h of cell time left (each as long as its arm's committed cells, else any)"
    return "\n".join(lines + [total])


def cell_time_left(cells: Sequence[Cell]) -> float | None:
    """Seconds the uncommitted cells still need, one after another: each as long as the committed cells of its
    configuration (median), else of any configuration, less the share its run dir has done; None before any
    cell is committed."""
    every = [w for c in cells if c.committed for w in [wall_seconds(c.dest)] if w is not None]
    if not every:
        return None
    fallback, deadline, length = statistics.median(every), Deadline(at=0.0), {}
    for c in cells:  # an arm's length once: each estimate reads its committed cells' metrics
        if not c.committed and c.dest.parent not in length:
            length[c.dest.parent] = deadline.estimate(c)[0] or fallback
    return sum((1.0 - done_fraction(c.run_dir)) * length[c.dest.parent] for c in cells if not c.committed)


def add_deadline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--finish-by",
        default=None,
        metavar="HH:MM",
        help="start no cell that would not finish by then (local time, or an ISO date-time): "
        "on a machine whose run dirs end with the session, a cell cut off is lost",
    )
    parser.add_argument(
        "--cell-minutes",
        type=float,
        default=None,
        help="how long one cell takes, for --finish-by (default: measured by this runner, else "
        "the median of the committed cells of its configuration)",
    )


def deadline_of(args: argparse.Namespace) -> Deadline | None:
    if args.finish_by is None:
        return None
    try:
        at = clock_time(args.finish_by)
    except ValueError as exc:
        raise SystemExit(f"--finish-by {exc}") from None
    return Deadline(at, None if args.cell_minutes is None else 60.0 * args.cell_minutes)


def run_cells(cells: Sequence[Cell], cwd: Path, tag: str, deadline: Deadline | None = None) -> int:
    """Run the cells not committed yet, in order, copying each as it finishes; stops at the first failure
    (returns its exit code; an interrupted cell resumes with the same command); a cell that would not finish by
    the deadline is left for later, and a shorter one after it may still run."""
    for cell in cells:
        if cell.committed:
            print(f"[{tag}] {cell.label}: committed already", flush=True)
            continue
        left = 1.0 - done_fraction(cell.run_dir)  # a cell resumed from its checkpoints has less to do
        if deadline is not None:
            length, how = deadline.estimate(cell)
            if length is not None and time.time() + left * length > deadline.at:
                by = datetime.fromtimestamp(deadline.at).strftime("%H:%M")
                print(
                    f"[{tag}] {cell.label}: not started, it would not finish by {by} (about "
                    f"{left * length / 60:.0f} min left of a cell that takes {length / 60:.0f}, {how})",
                    flush=True,
                )
                continue
        started = time.monotonic()
        if (cell.dest / "run.json").exists():
            print(
                f"[{tag}] {cell.label}: its metrics are committed but its weights are not here "
                f"({cell.dest / ADAPTER}), which later cells start from: running it again (its metrics will be "
                "replaced)",
                flush=True,
            )
        print(f"[{tag}] {cell.label}: running", flush=True)
        rc = run_forwarding_stops(cell.command, cwd)
        if rc != 0:
            print(f"[{tag}] {cell.label}: sapo-experiment exited {rc}; stopping", flush=True)
            return rc
        problems = unfinished(cell.run_dir, cell.check)
        if problems:
            print(f"[{tag}] {cell.label}: not copied, the run is not a result: {'; '.join(problems)}", flush=True)
            return 1
        try:
            peers = copy_cell(cell.run_dir, cell.dest, cell.adapter)
        except (OSError, RuntimeError) as exc:  # CheckpointError: the checkpoint to commit is missing or corrupt
            print(f"[{tag}] {cell.label}: not copied: {exc}", flush=True)
            return 1
        if deadline is not None:
            deadline.measure(cell, (time.monotonic() - started) / max(left, 0.05))  # a whole cell's length
        print(f"[{tag}] {cell.label}: finished, {peers} peers copied to {cell.dest}", flush=True)
    return 0
