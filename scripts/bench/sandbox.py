"""What scoring other peers' groups in the sandbox's child process costs, beside scoring them in-process.

    python -m scripts.bench.sandbox [--groups 200] [--tasks cpu-learn] [--completions 6]

Prints, for the same groups scored both ways (interleaved, so a machine's load changes both alike): the child's
start, the median and 95th percentile per group, and the ratio. node/swarm/sandbox.py says why it exists.
"""

from __future__ import annotations

import argparse
import statistics
import time

from node.learn.tasks import TaskSampler, resolve_mix, score_responses
from node.swarm.sandbox import ScoringSandbox


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--tasks", default="cpu-learn")
    ap.add_argument("--completions", type=int, default=6)
    args = ap.parse_args(argv)
    mix = resolve_mix(args.tasks)
    tasks = TaskSampler(mix, seed=1).sample(args.groups)
    wrong = ["<answer>0</answer>", "<answer>1 + 1 = 2</answer>", "no answer", "<answer>-7</answer>"]
    groups = [(t, ([f"<answer>{t.answer}</answer>"] + wrong * args.completions)[: args.completions]) for t in tasks]
    sandbox = ScoringSandbox()
    started = time.perf_counter()
    sandbox.score(groups[0][0].spec.to_wire(), groups[0][1], 60.0)  # the child's start and first imports
    start_s = time.perf_counter() - started
    in_process, in_child = [], []
    try:
        for task, responses in groups:
            t0 = time.perf_counter()
            here = score_responses(task, responses)
            t1 = time.perf_counter()
            there = sandbox.score(task.spec.to_wire(), responses, 60.0)
            t2 = time.perf_counter()
            assert there == here, (task.spec, here, there)
            in_process.append(t1 - t0)
            in_child.append(t2 - t1)
    finally:
        sandbox.close()

    def ms(values: list[float], q: float) -> float:
        return 1000 * statistics.quantiles(values, n=100)[int(q) - 1] if q < 100 else 1000 * max(values)

    print(f"{args.groups} groups of {args.completions} completions, mix {mix.name}; rewards equal both ways")
    print(f"child start (first group included): {start_s * 1000:.0f} ms")
    print(f"{'':12} {'median ms':>10} {'p95 ms':>8}")
    for name, values in (("in-process", in_process), ("sandbox", in_child)):
        print(f"{name:12} {ms(values, 50):>10.2f} {ms(values, 95):>8.2f}")
    print(f"ratio sandbox / in-process (medians): {ms(in_child, 50) / ms(in_process, 50):.1f}x")


if __name__ == "__main__":
    main()
