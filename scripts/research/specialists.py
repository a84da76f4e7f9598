"""The specialists experiment's rules, written before any of its cells ran (docs/experiments/specialists.md):
which datasets may be parts (`candidates`, on the task survey's committed cells), and which parts the sharing
pilot's five specialists practise (`pick_parts`, on the transfer pilot's committed cells).

    python -m scripts.research.specialists candidates                         # the survey's datasets that pass
    python -m scripts.research.specialists transfer docs/data/specialists-pilot [--json parts.json]

Transfer: T[i][j] is the held-out accuracy gain on part j (its last evaluation minus the starting weights') of
the silo peer that practised part i, averaged over the pilot's seeds; the diagonal is what practising a part
gives, the rest what it gives elsewhere. The pick keeps the learnable parts (T[i][i] >= MIN_OWN_GAIN), then
drops, one at a time, the part that another kept part teaches best, as a share of its own gain (the largest
T[i][j] / T[j][j]), while that share is above ROOM (a part another part already teaches leaves no room for
sharing to show); at most MAX_PARTS stay (the lowest shares). Five peers practise them in turn (peer p: part
p mod k).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from node.learn.tasks import PART_CONFIGS
from node.ops.metrics import read_records

SURVEY = Path("docs/data/survey/survey.json")
# the candidates' rule, on the survey's 64-task cells of the easiest config and the direct prompt
MIN_GAP = 0.14  # pass@8 - pass@1: sampling solves clearly more than greedy decoding (RL has something to raise)
MAX_BASELINE = 0.25  # one fixed answer per dataset scores at most this (guessing pays little)
MIN_DISTINCT_CORRECT = 8  # different right answers: not a few-answer dataset a policy learns to guess
MAX_MEDIAN_TOKENS = 32.0  # below the cap: the model answers within the budget (strictly below)
BROKEN_SCORERS = ("game_of_life_halting",)  # any answer scores 1.0 (docs/experiments/task-survey.md)
# the parts' rule, on the transfer pilot
MIN_OWN_GAIN = 0.10
ROOM = 0.5
MAX_PARTS = 5
PEERS = 5
PILOT_SEEDS = [100, 101]
PILOT_ARM = "4-0-specialists"  # the specialists' run dir under the pilot's data dir (slug of its label)
GENERALISTS_ARM = "4-0-generalists"


def candidates(cells: list[dict]) -> list[str]:
    """The datasets whose survey cell passes every bound (cpu-parts must hold exactly these), in the survey's
    order."""
    out = []
    for c in cells:
        if (c.get("level"), c.get("fmt"), c.get("n_tasks"), c.get("temperature")) != ("easiest", "direct", 64, 1.0):
            continue
        if c["dataset"] in BROKEN_SCORERS or c["dataset"] in out:
            continue
        if (
            c["pass8"] - c["pass1"] >= MIN_GAP - 1e-9
            and c["baseline"] <= MAX_BASELINE + 1e-9
            and c["distinct_correct"] >= MIN_DISTINCT_CORRECT
            and c["median_tokens"] < MAX_MEDIAN_TOKENS
        ):
            out.append(c["dataset"])
    return out


def peer_gains(metrics: Path) -> dict[str, float]:
    """Part -> held-out accuracy after the peer's last evaluation minus its starting weights'."""
    rows = read_records(metrics)
    start = next((r for r in rows if "start_accuracy" in r), None)
    last = next((r for r in reversed(rows) if "eval_accuracy" in r), None)
    if start is None or last is None:
        return {}
    return {
        part: last[f"eval_accuracy/{part}"] - start[f"start_accuracy/{part}"]
        for part in PART_CONFIGS
        if f"eval_accuracy/{part}" in last and f"start_accuracy/{part}" in start
    }


def transfer(data: Path, parts: list[str], seeds: list[int]) -> tuple[dict[str, dict[str, float]], list[str]]:
    """T[i][j] over the seeds whose cell is committed; and the seeds it read."""
    sums: dict[str, dict[str, list[float]]] = {i: {j: [] for j in parts} for i in parts}
    read = []
    for seed in seeds:
        run = data / PILOT_ARM / f"seed{seed}"
        if not (run / "run.json").exists():
            continue
        read.append(str(seed))
        for p, part in enumerate(parts):
            for j, gain in peer_gains(run / f"peer{p}" / "metrics.jsonl").items():
                sums[part][j].append(gain)
    matrix = {i: {j: statistics.fmean(v) if v else math.nan for j, v in row.items()} for i, row in sums.items()}
    return matrix, read


def pick_parts(matrix: dict[str, dict[str, float]]) -> dict:
    """The parts' rule (module docstring) on a transfer matrix; `kept` empty or of one part: no design."""
    learnable = [i for i in matrix if matrix[i][i] >= MIN_OWN_GAIN]
    kept, dropped = list(learnable), []

    def share(j: str) -> float:
        others = [matrix[i][j] for i in kept if i != j]
        return max(others) / matrix[j][j] if others else 0.0

    while len(kept) > 1:
        worst = max(kept, key=lambda j: (share(j), kept.index(j)))  # a tie: the later part goes
        if share(worst) <= ROOM and len(kept) <= MAX_PARTS:
            break
        dropped.append({"part": worst, "share": share(worst)})
        kept.remove(worst)
    return {
        "learnable": learnable,
        "dropped": dropped,
        "kept": kept,
        "shares": {j: share(j) for j in kept},
        "peers": {p: kept[p % len(kept)] for p in range(PEERS)} if len(kept) > 1 else {},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("candidates")
    c.add_argument("--survey", type=Path, default=SURVEY)
    t = sub.add_parser("transfer")
    t.add_argument("data", type=Path)
    t.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    parts = list(PART_CONFIGS)
    if args.cmd == "candidates":
        found = candidates(json.loads(args.survey.read_text()))
        print(" ".join(found))
        if sorted(found) != sorted(parts):
            print(f"differs from cpu-parts ({' '.join(parts)})", file=sys.stderr)
            return 1
        return 0
    matrix, seeds = transfer(args.data, parts, PILOT_SEEDS)
    if not seeds:
        print(f"no committed cell of {PILOT_ARM} in {args.data}", file=sys.stderr)
        return 2
    result = {"seeds": seeds, "complete": len(seeds) == len(PILOT_SEEDS), "transfer": matrix, **pick_parts(matrix)}
    print("practised \\ gain on: " + " ".join(f"{j[:12]:>12}" for j in parts))
    for i in parts:
        print(f"{i[:20]:<20} " + " ".join(f"{matrix[i][j]:+12.3f}" for j in parts))
    print(f"seeds {', '.join(seeds)}; learnable {result['learnable']}; kept {result['kept']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
