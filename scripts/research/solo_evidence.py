r"""The solo learning test on one run dir: did held-out accuracy rise, and is it above guessing?

Reads RUN_DIR/metrics.jsonl (written by sapo-node with --eval-every), takes the first and the last
held-out evaluation (the same fixed tasks, paired task by task) and prints, overall and per dataset: the
gain last - first and the margin last - constant-answer baseline, each with a paired bootstrap 95% CI,
and the share of distinct greedy answers (a policy collapsed onto fixed answers has almost none). The bar
of the solo learning test: gain >= 0.10 and margin >= 0.10 with both CIs above 0, per dataset as well as overall.
Where the rows carry the unseen set (a task mix split by content: questions whose content training
never draws), the same for it, and the CPU recipe's bar: in-distribution gain >= 0.30 and gain on the unseen
set >= 0.10, each with its CI above 0.

    python -m scripts.research.solo_evidence docs/data/solo-learn/lora-lr2e-4 \
        --json docs/data/solo-learn/lora-lr2e-4/evidence.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from node.lab.evidence import heldout_evidence
from node.ops.metrics import read_records

BAR = 0.10
RECIPE_IN_DISTRIBUTION_BAR = 0.30  # the CPU recipe's bar for a 100-round solo run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--boot", type=int, default=10000, help="bootstrap resamples")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        print(f"solo_evidence: no {path}", file=sys.stderr)
        return 2
    try:
        rows = read_records(path)
        ev = heldout_evidence(rows, n_boot=args.boot)
    except ValueError as exc:
        print(f"solo_evidence: {path}: {exc}", file=sys.stderr)
        return 2
    ev["meets_bar"] = print_set(ev, "held-out")
    print(f"solo learning test (gain and margin >= {BAR}, CIs above 0, every dataset): {ev['meets_bar']}")
    if any(r.get("eval_unseen_scores") for r in rows):
        unseen = ev["unseen"] = heldout_evidence(rows, n_boot=args.boot, key="eval_unseen")
        print()
        print_set(unseen, "unseen")
        g = unseen["overall"]
        ev["unseen_meets_bar"] = g["gain"] >= BAR and g["ci_low"] > 0
        seen = ev["overall"]
        ev["in_distribution_meets_issue29_bar"] = seen["gain"] >= RECIPE_IN_DISTRIBUTION_BAR and seen["ci_low"] > 0
        print(
            f"recipe bar: in-distribution gain >= {RECIPE_IN_DISTRIBUTION_BAR}, CI above 0: "
            f"{ev['in_distribution_meets_issue29_bar']}; gain on the unseen set >= {BAR}, CI above 0: "
            f"{ev['unseen_meets_bar']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(ev, indent=1) + "\n")
    return 0


def print_set(ev: dict, what: str) -> bool:
    """Prints one evaluation set's figures; returns whether it meets the solo learning test's bar."""
    d = ev["distinct_answers"]
    print(
        f"{what} accuracy {ev['first_accuracy']:.3f} after round {ev['first_round']} -> {ev['last_accuracy']:.3f} "
        f"after round {ev['last_round']}; constant-answer baseline {ev['baseline']:.3f}; distinct greedy answers "
        f"{d['first']} -> {d['last']} (gold {d['gold']})"
    )
    print(f"{'':18s} {'gain (95% CI)':>26s}   {'over baseline (95% CI)':>26s}  meets the bar")
    g, m = ev["overall"], ev["over_baseline"]
    ok = [g["gain"] >= BAR and g["ci_low"] > 0 and m["gain"] >= BAR and m["ci_low"] > 0]
    print(
        f"{'overall':18s} {g['gain']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}]"
        f"        {m['gain']:+.3f} [{m['ci_low']:+.3f}, {m['ci_high']:+.3f}]   {ok[0]}"
    )
    for name, g in ev["by_dataset"].items():
        m = g.get("over_baseline")
        hit = g["gain"] >= BAR and g["ci_low"] > 0 and (m is None or (m["gain"] >= BAR and m["ci_low"] > 0))
        ok.append(hit)
        margin = f"{m['gain']:+.3f} [{m['ci_low']:+.3f}, {m['ci_high']:+.3f}]" if m else f"{'(no baseline)':>26s}"
        print(
            f"{name:18s} {g['gain']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}]        {margin}   {hit}"
            f"   ({g['tasks']} tasks, distinct answers {g['distinct_answers_last']:.2f})"
        )
    return all(ok)


if __name__ == "__main__":
    raise SystemExit(main())
