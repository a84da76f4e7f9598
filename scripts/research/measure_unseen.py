"""A model's greedy accuracy on a mix's evaluation sets, as a node logs it at round 0: the in-distribution
held-out set and, for a mix split by content, the unseen set, each with its constant-answer baseline and
the size of its content (distinct questions and facts). `--harder` adds sets that no training config of the
mix can ask at all (more terms, more digits), the candidates for a second unseen set.

    nice python -m scripts.research.measure_unseen --tasks cpu-learn --size 128 --harder --json /tmp/unseen.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from node.learn.content import content_key
from node.learn.evaluate import EvalSet, evaluate
from node.learn.groups import Prompter
from node.learn.model_io import load_model
from node.learn.tasks import TaskMix, eval_tasks, resolve_mix

# Harder content than cpu-learn trains on: configs its mix never accepts, so these sets are unseen too.
HARDER = {
    "3 terms, 1 digit": {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    "2 terms, 2 digits": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
}


def harder_mix(mix: TaskMix, change: dict) -> TaskMix:
    """The mix with every arithmetic config changed (no content split: nothing of it is trained on)."""
    datasets = {
        name: {**entry, "config": {**entry.get("config", {}), **change}} for name, entry in mix.datasets.items()
    }
    return TaskMix(
        name=f"{mix.name}+harder",
        datasets=datasets,
        system_prompt=mix.system_prompt,
        answer_prefix=mix.answer_prefix,
        max_new_tokens=mix.max_new_tokens,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", default="cpu-learn")
    ap.add_argument("--size", type=int, default=128, help="tasks per set")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--harder", action="store_true", help="also the harder sets (more terms, more digits)")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mix = resolve_mix(args.tasks)
    model, tokenizer = load_model(args.model, torch.device("cpu"))
    prompter = Prompter(tokenizer, mix)
    sets = {"in-distribution": eval_tasks(mix, args.size), "unseen": eval_tasks(mix, args.size, unseen=True)}
    if args.harder:
        sets.update({name: eval_tasks(harder_mix(mix, change), args.size) for name, change in HARDER.items()})
    out = {"model": args.model, "tasks": mix.name, "size": args.size, "sets": {}}
    for name, tasks in sets.items():
        if not tasks:
            print(f"{name:18s} (none: the mix has no content split)")
            continue
        labelled = EvalSet.of(tasks)
        result = labelled.label(evaluate(model, tokenizer, prompter, tasks, mix.max_new_tokens))
        keys = {content_key(t.spec.dataset, t.entry) for t in tasks}
        row = {
            "accuracy": round(result.accuracy, 4),
            "baseline": round(labelled.baseline, 4),
            "by_dataset": {k: round(v, 4) for k, v in result.by_dataset.items()},
            "baseline_by_dataset": {k: round(v, 4) for k, v in labelled.baseline_by_dataset.items()},
            "tasks": len(tasks),
            "distinct_questions": len({t.question for t in tasks}),
            "facts": len(keys),
            "seconds": round(result.seconds, 1),
        }
        out["sets"][name] = row
        per = ", ".join(
            f"{k} {v:.3f} (const {row['baseline_by_dataset'][k]:.3f})" for k, v in row["by_dataset"].items()
        )
        print(
            f"{name:18s} accuracy {row['accuracy']:.3f} | constant answer {row['baseline']:.3f} | "
            f"{len(tasks)} tasks, {row['distinct_questions']} questions, {row['facts']} facts | {per} | "
            f"{row['seconds']}s",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
