"""The solo learning test (does one node learn on a CPU?): held-out accuracy of one run at its first and last
evaluation, paired task by task
(the held-out set is fixed and every evaluation row lists its per-task scores), with bootstrap CIs of the
gain and of the margin over the constant-answer baseline, overall and per dataset. Used by
scripts/research/solo_evidence.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def paired_task_gain(
    first: Sequence[float], last: Sequence[float], n_boot: int = 10000, seed: int = 0
) -> dict[str, float]:
    """Mean of last - first over the same tasks (two evaluations of one fixed held-out set) with a paired
    bootstrap 95% CI: tasks are resampled, each keeping both of its scores."""
    a, b = np.asarray(first, dtype=float), np.asarray(last, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError("two evaluations of the same tasks are needed")
    diff = b - a
    idx = np.random.default_rng(seed).integers(0, diff.size, size=(n_boot, diff.size))
    lo, hi = np.percentile(diff[idx].mean(axis=1), [2.5, 97.5])
    return {"gain": float(diff.mean()), "ci_low": float(lo), "ci_high": float(hi), "tasks": int(diff.size)}


def heldout_evidence(rows: Sequence[dict], n_boot: int = 10000, seed: int = 0, key: str = "eval") -> dict:
    """The solo learning test from one run's metrics rows: the first and the last evaluation that carry
    per-task scores, the paired gain (last - first) and the margin over the constant-answer baseline
    (last - baseline), each with a bootstrap 95% CI, overall and per dataset, and the share of distinct
    greedy answers (against the gold answers' own share) at both ends. `key` "eval_unseen": the same on
    the unseen set (questions whose content training never draws; mixes split by content)."""
    evals = [r for r in rows if r.get(f"{key}_scores")]
    if len(evals) < 2:
        raise ValueError(f"need two evaluations with per-task scores ({key}_scores)")
    first, last = evals[0], evals[-1]
    datasets = sorted({k.split("/", 1)[1] for k in last if k.startswith(f"{key}_accuracy/")})
    answers = last.get(f"{key}_answers") or []
    per_task = last.get(f"{key}_datasets") or []
    scores = last[f"{key}_scores"]
    if len(per_task) != len(scores):
        raise ValueError(f"the evaluation rows do not name each task's dataset ({key}_datasets)")
    out = {
        "first_round": first["round"],
        "last_round": last["round"],
        "baseline": last.get(f"{key}_baseline"),
        "first_accuracy": first[f"{key}_accuracy"],
        "last_accuracy": last[f"{key}_accuracy"],
        "distinct_answers": {
            "first": first.get(f"{key}_distinct_answers"),
            "last": last.get(f"{key}_distinct_answers"),
            "gold": last.get(f"{key}_distinct_gold"),
        },
        "overall": paired_task_gain(first[f"{key}_scores"], scores, n_boot, seed),
    }
    base = last.get(f"{key}_baseline") or 0.0
    out["over_baseline"] = paired_task_gain([base] * len(scores), scores, n_boot, seed)
    out["by_dataset"] = {}
    for name in datasets:
        sel = [i for i, d in enumerate(per_task) if d == name]
        gain: dict[str, Any] = paired_task_gain(
            [first[f"{key}_scores"][i] for i in sel], [scores[i] for i in sel], n_boot, seed
        )
        gain["distinct_answers_last"] = len({answers[i] for i in sel if i < len(answers) and answers[i]}) / len(sel)
        ds_base = last.get(f"{key}_baseline/{name}")
        if ds_base is not None:
            gain["over_baseline"] = paired_task_gain([ds_base] * len(sel), [scores[i] for i in sel], n_boot, seed)
        out["by_dataset"][name] = gain
    return out
