"""How a run's greedy held-out answers are written, and what they would score read another way.

    python -m scripts.research.answer_forms docs/data/recipe-sweep/lr1e-4-b0/4-0/seed100 [more cell dirs]

For every peer's evaluations (metrics.jsonl keeps each greedy answer), against the gold answers of the mix's
held-out set regenerated here: accuracy as the node scored it (reasoning-gym's scorer on the extracted
answer), the share of answers written as an equation ("3 - 2 = 1"), and how many of those equations end in
the right result. Written for RESULTS 7, where every peer that met the collapse definition had turned to
equations whose results were mostly right; reasoning-gym gives such an answer partial credit (the gold
answer's length over the answer's) when it contains the gold answer, and 0 to a plain wrong number.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from node.learn.tasks import Task, eval_tasks, read_answer, resolve_mix, score

REPO = Path(__file__).resolve().parents[2]


def result_of(answer: str) -> str | None:
    """The right-hand side of an equation answer, or None for an answer that is not one: the node's `result`
    rule, and a trailing full stop dropped too (`6 - 9 = 1.`), which the node's rule keeps."""
    if answer is None or "=" not in answer:
        return None
    return read_answer(answer, "result").rstrip(".").strip()


def forms(answers: list[str], tasks: list[Task]) -> dict:
    """Equation share, the share of equations whose result scores 1, and the mean score with every equation
    read as its result (reasoning-gym's scorer throughout; other answers score as the node scored them)."""
    eq = [(a, t) for a, t in zip(answers, tasks) if result_of(a) is not None]
    right = sum(score(t, result_of(a)) >= 1.0 for a, t in eq)
    read = [score(t, result_of(a) if result_of(a) is not None else a) for a, t in zip(answers, tasks)]
    return {
        "equation_share": len(eq) / len(answers),
        "equation_result_right": right / len(eq) if eq else None,
        "read_as_result": sum(read) / len(read),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", nargs="+", type=Path)
    args = ap.parse_args()
    print(
        "| cell | peer | round | accuracy (node) | equation answers | equations with the right result "
        "| accuracy read as the result |"
    )
    print("|---|---|---|---|---|---|---|")
    for cell in args.cells:
        run = orjson.loads((cell / "run.json").read_bytes())
        mix = resolve_mix(run["tasks"])
        for metrics in sorted(cell.glob("peer*/metrics.jsonl")):
            evals = [rec for rec in map(orjson.loads, metrics.read_bytes().splitlines()) if "eval_answers" in rec]
            for rec in evals[-1:]:
                f = forms(rec["eval_answers"], eval_tasks(mix, len(rec["eval_answers"])))
                right = "–" if f["equation_result_right"] is None else f"{f['equation_result_right']:.2f}"
                print(
                    f"| {cell.name} | {metrics.parent.name} | {rec['round']} | {rec['eval_accuracy']:.3f} "
                    f"| {f['equation_share']:.2f} | {right} | {f['read_as_result']:.3f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
