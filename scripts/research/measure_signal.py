"""Learning signal of a task mix at round 0: the share of groups holding both a fully correct completion
(score 1.0) and a wrong one (score < 1.0). Partial credit does not count as correct. Uses the node's own
prompt, sampler and reward.

    python -m scripts.research.measure_signal --model default --tasks cpu-easy --groups 48 --generations 6
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from node.learn.groups import Prompter, local_group, right_and_wrong
from node.learn.model_io import load_model, pick_device
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import TaskSampler, resolve_mix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", default="cpu-easy")
    ap.add_argument("--groups", type=int, default=48)
    ap.add_argument("--generations", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="tasks per generate call")
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    mix = resolve_mix(args.tasks)
    model, tok = load_model(args.model, pick_device("auto"))
    prompter = Prompter(tok, mix)
    sampler = TaskSampler(mix, args.seed)
    cfg = SamplingConfig(max_new_tokens=mix.max_new_tokens)
    per = defaultdict(lambda: [0, 0, 0.0])  # dataset -> [groups, mixed, reward sum]
    t0 = time.time()
    done = 0
    while done < args.groups:
        tasks = sampler.sample(min(args.batch, args.groups - done))
        sampled = sample_groups(model, tok, [prompter(t) for t in tasks], args.generations, cfg)
        for t, s in zip(tasks, sampled):
            g = local_group(t, s, mix.answer_prefix)
            mixed = right_and_wrong(g.rewards)
            stats = per[t.spec.dataset]
            stats[0] += 1
            stats[1] += int(mixed)
            stats[2] += sum(g.rewards) / len(g.rewards)
        done += len(tasks)
    total = [sum(v[i] for v in per.values()) for i in range(3)]
    print(f"# model={args.model} tasks={mix.name} G={args.generations} seed={args.seed} ({time.time() - t0:.0f}s)")
    print(f"{'dataset':18s} {'groups':>6s} {'signal':>7s} {'reward':>7s}")
    for name, (n, mixed, rsum) in sorted(per.items()):
        print(f"{name:18s} {n:6d} {mixed / n:7.2f} {rsum / n:7.3f}")
    print(f"{'ALL':18s} {total[0]:6d} {total[1] / total[0]:7.2f} {total[2] / total[0]:7.3f}")


if __name__ == "__main__":
    main()
