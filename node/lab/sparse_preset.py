"""Choosing a sparse-signal task preset by a rule fixed before measuring (docs/experiments/off-policy-sharing.md).

SAPO's mechanism needs a regime where a peer's own groups rarely carry a learning signal and the swarm's
do. Each candidate below is measured with the node's own prompt, sampler (the rollout engine a node uses) and
reward, on fresh training tasks and on the held-out set; the first candidate, in the order listed, that meets
every bound of `SparseRule` becomes the `cpu-sparse` preset (cpu-learn's family, node/learn/tasks.py
`arithmetic_mix`, with other term and digit counts). Raw records: one JSON line per candidate.

    python -m node.lab.sparse_preset --out docs/data/offpolicy/preset.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from node.learn.tasks import TaskMix, arithmetic_mix

log = logging.getLogger("sapo.lab")

# in the order of preference, written before any was measured
CANDIDATES: dict[str, TaskMix] = {
    "two-digit": arithmetic_mix("two-digit", terms=2, min_digits=2, max_digits=2),
    "three-term": arithmetic_mix("three-term", terms=3, min_digits=1, max_digits=1),
    "mixed-digit": arithmetic_mix("mixed-digit", terms=2, min_digits=1, max_digits=2),
}


@dataclass(frozen=True)
class SparseRule:
    """Bounds a candidate must meet (docs/experiments/off-policy-sharing.md gives the reasons)."""

    min_signal: float = 0.05  # share of fresh groups (G completions) holding a right and a wrong answer
    max_signal: float = 0.25
    max_baseline: float = 0.15  # constant-answer baseline on the held-out set: guessing must not pay
    max_pass1: float = 0.30  # greedy held-out accuracy at the start: room to learn
    max_median_tokens: float = 16.0  # CPU rounds stay short

    def failures(self, rec: dict[str, Any]) -> list[str]:
        out = []
        if not self.min_signal <= rec["signal_frac"] <= self.max_signal:
            out.append(f"signal {rec['signal_frac']:.3f} outside [{self.min_signal}, {self.max_signal}]")
        if rec["baseline"] > self.max_baseline:
            out.append(f"baseline {rec['baseline']:.3f} > {self.max_baseline}")
        if rec["pass1"] > self.max_pass1:
            out.append(f"pass@1 {rec['pass1']:.3f} > {self.max_pass1}")
        if rec["median_tokens"] > self.max_median_tokens:
            out.append(f"median tokens {rec['median_tokens']} > {self.max_median_tokens}")
        if not rec["has_unseen"]:
            out.append("no unseen evaluation set")
        return out


def choose(records: list[dict[str, Any]], rule: SparseRule = SparseRule()) -> str | None:
    """The first candidate (in CANDIDATES order) that meets every bound, or None."""
    by_name = {r["candidate"]: r for r in records}
    for name in CANDIDATES:
        if name in by_name and not rule.failures(by_name[name]):
            return name
    return None


def measure(
    name: str, mix: TaskMix, model, tokenizer, engine, groups: int, generations: int, eval_size: int, seed: int
) -> dict[str, Any]:
    """One candidate's record: fresh training groups sampled as a node samples them, and the held-out set's
    greedy accuracy (torch) and constant-answer baseline."""
    from node.learn.evaluate import constant_answer_baseline, greedy_texts
    from node.learn.groups import Prompter, local_group, right_and_wrong, score_responses
    from node.learn.sampling import SamplingConfig
    from node.learn.tasks import TaskSampler, eval_tasks

    prompter = Prompter(tokenizer, mix)
    sampler = TaskSampler(mix, seed)
    cfg = SamplingConfig(max_new_tokens=mix.max_new_tokens)
    t0 = time.perf_counter()
    mixed, rewards, lengths = 0, [], []
    for start in range(0, groups, 8):
        tasks = sampler.sample(min(8, groups - start))
        for task, sampled in zip(tasks, engine.sample([prompter(t) for t in tasks], generations, cfg)):
            g = local_group(task, sampled, mix.answer_prefix)
            mixed += right_and_wrong(g.rewards)
            rewards += g.rewards
            lengths += [len(ids) for ids in sampled.completion_ids]
    t_sample = time.perf_counter() - t0
    held_out = eval_tasks(mix, eval_size)
    greedy = greedy_texts(model, tokenizer, [prompter(t) for t in held_out], mix.max_new_tokens, 16)
    scores = [score_responses(t, [mix.answer_prefix + text])[0] for t, text in zip(held_out, greedy)]
    return {
        "candidate": name,
        "mix": mix.to_dict(),
        "groups": groups,
        "generations": generations,
        "seed": seed,
        "engine": engine.name,
        "signal_frac": round(mixed / groups, 4),
        "sample_mean": round(sum(rewards) / len(rewards), 4),
        "median_tokens": statistics.median(lengths),
        "eval_size": len(held_out),
        "pass1": round(sum(s >= 1.0 for s in scores) / len(scores), 4),
        "baseline": round(constant_answer_baseline(held_out), 4),
        "has_unseen": mix.has_unseen(),
        "sample_s": round(t_sample, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--groups", type=int, default=96, help="fresh training groups per candidate")
    ap.add_argument("--generations", type=int, default=6)
    ap.add_argument("--eval-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", default="auto", help="the rollout engine, as a node chooses it (auto: llama.cpp)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="JSONL: one record per candidate (appended)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch

    from node.learn.engines import make_engine
    from node.learn.model_io import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, torch.device("cpu"))
    engine = make_engine(args.engine, model, tok, args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for name in args.candidates:
        rec = measure(
            name, CANDIDATES[name], model, tok, engine, args.groups, args.generations, args.eval_size, args.seed
        )
        rec["rule_failures"] = SparseRule().failures(rec)
        rec["rule"] = asdict(SparseRule())
        records.append(rec)
        with args.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(
            f"{name:12s} signal {rec['signal_frac']:.3f}  pass@1 {rec['pass1']:.3f}  baseline {rec['baseline']:.3f}"
            f"  median tokens {rec['median_tokens']}  {rec['seconds']:.0f}s  fails: {rec['rule_failures'] or '-'}",
            flush=True,
        )
    engine.close()
    print(f"chosen: {choose(records)}")


if __name__ == "__main__":
    main()
