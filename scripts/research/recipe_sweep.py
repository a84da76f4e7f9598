"""The recipe sweep of docs/experiments/cpu-recipe.md: run its cells, and apply its rule to what they show.

    python -m scripts.research.recipe_sweep run [--part 0/2] [--settings lr1e-4-b0 ...] [--seeds 100 101 102]
    python -m scripts.research.recipe_sweep summarize [--data docs/data/recipe-sweep-v3] [--json out.json]

`run` runs each (setting, seed) cell as one `sapo-experiment 4/0` in memory mode (resumable: a finished cell
is skipped, an unfinished one continues from its checkpoints) and copies a finished cell's run.json and
peer*/metrics.jsonl to docs/data/recipe-sweep-v3/<setting>/4-0/seed<k>/ (cpu-learn v3, RESULTS 7a; the v2
cells stay in docs/data/recipe-sweep/, `summarize --data` reads them), where `sapo-report` reads them too.
`--part i/n` takes every n-th cell, so n processes share the grid on n cores.

`summarize` reads the committed cells and applies the rule written before the sweep: among settings with
no collapsed peer (node/learn/guard.py `collapsed`, on each peer's final evaluation), the highest mean final
held-out accuracy; within 0.01 of the best is a tie, won by the lower learning rate, then by beta 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from node.lab.cells import Cell, add_deadline_args, deadline_of, part_of, run_cells
from node.lab.runs import last_evaluation
from node.learn.guard import EvalSummary, collapsed
from node.ops.metrics import read_records

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Setting:
    name: str
    lr: float
    beta: float


# in the order the design runs them
GRID = [
    Setting("lr1e-4-b0", 1e-4, 0.0),
    Setting("lr2e-4-b0", 2e-4, 0.0),
    Setting("lr1e-4-b0.04", 1e-4, 0.04),
    Setting("lr2e-4-b0.04", 2e-4, 0.04),
    Setting("lr5e-5-b0", 5e-5, 0.0),
    Setting("lr5e-5-b0.04", 5e-5, 0.04),
]
SEEDS = [100, 101, 102]
CONFIG = "4/0"
ROUNDS = 30
TIE = 0.01


def cell_command(s: Setting, seed: int, out: Path, engine: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "node.lab.experiment",
        CONFIG,
        "--out",
        str(out),
        "--rounds",
        str(ROUNDS),
        "--mode",
        "memory",
        "--lora-rank",
        "8",
        "--lr",
        str(s.lr),
        "--tasks",
        "cpu-learn",
        "--eval-every",
        "10",
        "--eval-size",
        "128",
        "--threads",
        "1",
        "--seeds",
        str(seed),
        f"--node-arg=--beta={s.beta}",
        f"--node-arg=--rollout-engine={engine}",
    ]


def cells(args: argparse.Namespace) -> list[Cell]:
    grid = [s for s in GRID if not args.settings or s.name in args.settings]
    seed_dir = CONFIG.replace("/", "-")
    return part_of(
        [
            Cell(
                f"{s.name} seed {seed}",
                cell_command(s, seed, Path(args.runs) / s.name, args.engine),
                Path(args.runs) / s.name / seed_dir / f"seed{seed}",
                Path(args.data) / s.name / seed_dir / f"seed{seed}",
            )
            for s in grid
            for seed in args.seeds
        ],
        args.part,
    )


def final_eval(metrics: Path) -> tuple[EvalSummary, dict] | None:
    return last_evaluation(read_records(metrics))


def finals_row(finals: list[tuple[EvalSummary, dict]]) -> dict:
    """What the table reports of a set of peers' final evaluations."""
    accs = [e.accuracy for e, _ in finals]
    unseen = [rec["eval_unseen_accuracy"] for _, rec in finals if rec.get("eval_unseen_accuracy") is not None]
    return {
        "peers": len(finals),
        "final_rounds": sorted({e.round for e, _ in finals}),
        "mean_final_accuracy": sum(accs) / len(accs),
        "collapsed": sum(collapsed(e) for e, _ in finals),
        "mean_final_unseen": sum(unseen) / len(unseen) if unseen else None,
        "guard_restores": sum(int(rec.get("guard_restores", 0)) for _, rec in finals),
    }


def summarize(args: argparse.Namespace) -> int:
    rows, seed_rows = [], []
    for s in GRID:
        by_seed: dict[str, list] = {}
        for metrics in sorted((Path(args.data) / s.name).glob("*/seed*/peer*/metrics.jsonl")):
            found = final_eval(metrics)
            if found is not None:
                by_seed.setdefault(metrics.parent.parent.name, []).append(found)
        if not by_seed:
            continue
        seed_rows += [{"setting": s.name, "seed": seed, **finals_row(f)} for seed, f in by_seed.items()]
        rows.append(
            {
                "setting": s.name,
                "lr": s.lr,
                "beta": s.beta,
                "seeds": len(by_seed),
                **finals_row([f for fs in by_seed.values() for f in fs]),
            }
        )
    complete = [r for r in rows if r["seeds"] >= len(SEEDS) and r["final_rounds"] == [ROUNDS - 1]]
    winner, note = pick(complete)
    print("| setting | seed | peers | collapsed | mean final held-out | mean final unseen | guard restores |")
    print("|---|---|---|---|---|---|---|")
    for r in seed_rows + [{**r, "seed": "all"} for r in rows]:
        unseen = f"{r['mean_final_unseen']:.3f}" if r["mean_final_unseen"] is not None else "–"
        print(
            f"| {r['setting']} | {r['seed'].removeprefix('seed')} | {r['peers']} | {r['collapsed']} "
            f"| {r['mean_final_accuracy']:.3f} | {unseen} | {r['guard_restores']} |"
        )
    print(f"\nrule: {note}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "seed_rows": seed_rows, "winner": winner, "note": note}, indent=1)
        )
    return 0


def pick(rows: list[dict]) -> tuple[str | None, str]:
    """The pre-registered rule (docs/experiments/cpu-recipe.md) on complete settings."""
    if len(rows) < len(GRID):
        return None, f"{len(rows)} of {len(GRID)} settings complete; the rule waits for all"
    fewest = min(r["collapsed"] for r in rows)
    eligible = [r for r in rows if r["collapsed"] == fewest]
    best = max(r["mean_final_accuracy"] for r in eligible)
    tied = sorted((r for r in eligible if r["mean_final_accuracy"] >= best - TIE), key=lambda r: (r["lr"], r["beta"]))
    bar = "no collapsed peer" if fewest == 0 else f"NOT MET: the fewest collapsed peers is {fewest}"
    return tied[0]["setting"], f"{tied[0]['setting']} ({bar}; {len(tied)} setting(s) within {TIE} of the best)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--part", default="0/1", help="i/n: every n-th cell starting at i")
    r.add_argument("--settings", nargs="*", default=None, help="names from the grid (default: all)")
    r.add_argument("--seeds", nargs="*", type=int, default=SEEDS)
    r.add_argument("--runs", default="runs/recipe-sweep-v3", help="where the run dirs live (not committed)")
    r.add_argument("--data", default=str(REPO / "docs/data/recipe-sweep-v3"))
    r.add_argument("--engine", default="auto", help="--rollout-engine of every peer")
    add_deadline_args(r)
    s = sub.add_parser("summarize")
    s.add_argument("--data", default=str(REPO / "docs/data/recipe-sweep-v3"))
    s.add_argument("--json", default=None)
    args = parser.parse_args()
    return run_cells(cells(args), REPO, "sweep", deadline_of(args)) if args.cmd == "run" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
