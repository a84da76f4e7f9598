"""The off-policy pilot's pick and sizing rules, applied to its committed cells (written before any cell ran:
docs/experiments/off-policy-sharing.md, part 2). Prints every arm's paired held-out area difference against
the silo, the loss the confirmatory run takes and how many paired seeds it needs.

    python -m scripts.research.offpolicy_pick docs/data/offpolicy-pilot [--json pick.json]

Pick: the largest mean paired area difference (arm - silo, the mean peer's held-out area per seed) among the
candidates; a difference within TIE of the best goes to the simpler rule, in the order of CANDIDATES. Sizing:
n = (2.8 s / max(d, MIN_EFFECT))^2 paired seeds for 80% power at a two-sided 0.05 (d, s: the chosen loss's
mean and standard deviation of the paired differences); the run takes max(8, n).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from node.lab.runs import load_runs
from node.lab.stats import eval_area, eval_curve

SILO = "4/0"
REFERENCE = "sapo"  # the paper's rule: reported, never picked
CANDIDATES = ("positive", "ftis", "is")  # the simpler rule first: ties go to it
TIE = 0.005
MIN_EFFECT = 0.03
Z_SUM = 2.8  # z(0.975) + z(0.80)
MIN_SEEDS = 8
PILOT_SEEDS = [100, 101, 102]  # the confirmatory run's seeds are 0-7


def areas_by_config(data: Path) -> dict[str, dict[str, float]]:
    """config -> seed -> the mean peer's held-out area (trapezoids over its evaluations, over the span)."""
    out: dict[str, dict[str, float]] = {}
    for run in load_runs([data]):
        rounds, acc = eval_curve(run)
        if acc.size:
            out.setdefault(run.config, {})[run.seed] = eval_area(rounds, acc)
    return out


def paired(arm: dict[str, float], silo: dict[str, float]) -> dict:
    seeds = sorted(set(arm) & set(silo), key=lambda s: (len(s), s))
    diffs = [arm[s] - silo[s] for s in seeds]
    return {
        "seeds": seeds,
        "diffs": diffs,
        "mean": statistics.fmean(diffs) if diffs else math.nan,
        "sd": statistics.stdev(diffs) if len(diffs) > 1 else math.nan,
    }


def pick(areas: dict[str, dict[str, float]], seeds: list[int]) -> dict:
    """Every arm's paired comparison with the silo, the chosen loss and the confirmatory run's size;
    `complete`: every arm, the silo's included, has each of the pilot's `seeds`."""
    silo = areas.get(SILO, {})
    arms = {rule: paired(areas.get(f"2/2 {rule}", {}), silo) for rule in (REFERENCE, *CANDIDATES)}
    ready = [r for r in CANDIDATES if arms[r]["diffs"]]
    if not ready:
        return {"arms": arms, "chosen": None, "reason": "no candidate has a seed paired with the silo yet"}
    best = max(arms[r]["mean"] for r in ready)
    chosen = next(r for r in CANDIDATES if r in ready and arms[r]["mean"] >= best - TIE)
    d, s = arms[chosen]["mean"], arms[chosen]["sd"]
    n = math.ceil((Z_SUM * s / max(d, MIN_EFFECT)) ** 2) if math.isfinite(s) else None
    complete = all(set(arms[r]["seeds"]) >= {str(s) for s in seeds} for r in (REFERENCE, *CANDIDATES))
    return {
        "arms": arms,
        "chosen": chosen,
        "needed_seeds": n,
        "seeds": max(MIN_SEEDS, n) if n is not None else MIN_SEEDS,
        "complete": complete,
    }


def confirmatory_arms(data: Path, seeds: list[int] = PILOT_SEEDS) -> list[str]:
    """The confirmatory run's arms (docs/experiments/off-policy-sharing.md, part 3): the silo, the loss this
    rule picks from the pilot's committed cells, and the paper's rule; ValueError until every pilot cell is in."""
    areas = areas_by_config(data)
    result = pick(areas, seeds) if SILO in areas else {"chosen": None, "complete": False}
    if result["chosen"] is None or not result["complete"]:
        raise ValueError(
            f"the off-policy pilot is not finished in {data} (every arm needs seeds {', '.join(map(str, seeds))}): "
            "its pick chooses the confirmatory run's loss; run --experiment offpolicy-pilot first"
        )
    return ["silo", result["chosen"], REFERENCE]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="the pilot's committed cells (docs/data/offpolicy-pilot)")
    ap.add_argument("--json", default="", help="also write the result here")
    ap.add_argument("--seeds", nargs="+", type=int, default=PILOT_SEEDS, help="the pilot's seeds (100 101 102)")
    args = ap.parse_args(argv)
    areas = areas_by_config(Path(args.data))
    if SILO not in areas:
        print(f"offpolicy_pick: no silo ({SILO}) cell in {args.data} yet", file=sys.stderr)
        return 1
    result = pick(areas, args.seeds)
    print(f"silo areas by seed: {json.dumps({k: round(v, 4) for k, v in areas[SILO].items()})}")
    for rule, arm in result["arms"].items():
        diffs = ", ".join(f"{s}: {d:+.4f}" for s, d in zip(arm["seeds"], arm["diffs"])) or "no paired seed yet"
        role = "reference" if rule == REFERENCE else "candidate"
        print(f"2/2 {rule:8s} ({role}): mean {arm['mean']:+.4f} sd {arm['sd']:.4f}  [{diffs}]")
    if result["chosen"] is None:
        print(result["reason"])
    else:
        state = "all cells in" if result["complete"] else "NOT all cells in yet: provisional"
        print(
            f"pick: {result['chosen']} ({state}); the confirmatory run needs n = {result['needed_seeds']} paired "
            f"seeds for 80% power: it runs {result['seeds']} if the budget allows, else {MIN_SEEDS}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
