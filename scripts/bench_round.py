#!/usr/bin/env python
"""Round benchmark: per-phase seconds of real rounds, and the node's two hot paths against bare baselines.

Prints three figures (measured side by side in this run, same batch, same seed):
  1. per-phase seconds of N solo rounds (generate, score, train, ...), from the node's own metrics
  2. generation throughput of the node's sampler (behaviour log-probs recorded) / bare model.generate
     (target >= 0.95)
  3. GRPO optimizer step time / a bare forward+backward(+Adam step) over the same tokens (target <= 1.2)

    python scripts/bench_round.py --model default --tasks cpu-easy --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from node.ops.config import load_config  # noqa: E402
from node.swarm.exchange import Silo  # noqa: E402
from node.learn.groups import Prompter, local_group, to_sequences  # noqa: E402
from node.loop import SapoNode  # noqa: E402
from node.learn.policy import SamplingConfig, load_model, pick_device, sample_groups  # noqa: E402
from node.learn.tasks import TaskSampler, resolve_mix  # noqa: E402
from node.learn.trainer import TrainConfig, Trainer  # noqa: E402


def timed(fn, repeats: int) -> list[float]:
    out = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", default="cpu-easy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-local", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    device = pick_device(args.device)
    mix = resolve_mix(args.tasks)
    max_new = args.max_new_tokens or mix.max_new_tokens
    print(f"# model={args.model} device={device} threads={torch.get_num_threads()} tasks={mix.name} "
          f"I={args.num_local} G={args.generations} max_new_tokens={max_new} torch={torch.__version__}")
    model, tok = load_model(args.model, device)

    # 1. real rounds through the node's loop (silo)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(["--model", args.model, "--tasks", args.tasks, "--rounds", str(args.rounds),
                           "--num-local", str(args.num_local), "--generations", str(args.generations),
                           "--max-new-tokens", str(max_new), "--run-dir", run_dir, "--checkpoint-every",
                           str(10**6), "--device", str(device)], env={})
        node = SapoNode(cfg, mix, model, tok, Silo(), device)
        records = []

        async def go():
            for r in range(args.rounds):
                records.append((await node.run_round(r)).record)

        asyncio.run(go())
        node.worker.shutdown()
    phases = sorted({k for r in records for k in r["phase_s"]})
    print("\n## 1. per-phase seconds (median over rounds)")
    for p in phases:
        print(f"  {p:10s} {statistics.median(r['phase_s'].get(p, 0.0) for r in records):8.3f}")
    print(f"  {'round':10s} {statistics.median(r['round_s'] for r in records):8.3f}")

    # 2. generation: node sampler vs bare generate, same prompts, same seeds
    prompter = Prompter(tok, mix)
    tasks = TaskSampler(mix, seed=123).sample(args.num_local)
    prompts = [prompter(t) for t in tasks]
    scfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=max_new)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    plen = enc["input_ids"].shape[1]
    node_tokens, bare_tokens = [], []

    def node_gen(i):
        torch.manual_seed(1000 + i)
        groups = sample_groups(model, tok, prompts, args.generations, scfg)
        node_tokens.append(sum(len(c) for g in groups for c in g.completion_ids))

    @torch.no_grad()
    def bare_gen(i):
        torch.manual_seed(1000 + i)
        model.eval()
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new,
                             num_return_sequences=args.generations, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        model.train()
        gen = out[:, plen:]
        eos = tok.eos_token_id
        bare_tokens.append(sum((row.tolist().index(eos) + 1) if eos in row.tolist() else len(row) for row in gen))

    node_gen(-1), bare_gen(-1)  # warm-up
    node_tokens.clear(), bare_tokens.clear()
    t_node, t_bare = [], []
    for i in range(args.repeats):  # interleaved so drift hits both equally
        t_node += timed(lambda _: node_gen(i), 1)
        t_bare += timed(lambda _: bare_gen(i), 1)
    node_tps = sum(node_tokens) / sum(t_node)
    bare_tps = sum(bare_tokens) / sum(t_bare)
    print("\n## 2. generation throughput (tokens/s)")
    print(f"  node sampler {node_tps:9.1f}   bare generate {bare_tps:9.1f}   ratio {node_tps / bare_tps:.3f} "
          f"(target >= 0.95; same seeds, tokens {sum(node_tokens)} vs {sum(bare_tokens)})")

    # 3. GRPO step vs bare forward+backward+Adam over the same tokens
    sampled = sample_groups(model, tok, prompts, args.generations, scfg)
    groups = [local_group(t, s, mix.answer_prefix) for t, s in zip(tasks, sampled)]
    for g in groups:  # force a signal so every sequence trains
        g.rewards = [float(i % 2) for i in range(len(g.rewards))]
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-7, micro_batch_size=len(seqs)))
    from node.learn.policy import pad_batch

    ids, attn, positions, comp_ids, _ = pad_batch(seqs, tok.pad_token_id, device)
    keep = comp_ids.shape[1] + 1  # the same completion-only logits the trainer computes
    bare_opt = torch.optim.Adam(model.parameters(), lr=1e-7)

    def grpo_step(_):
        trainer.step(seqs)

    def bare_step(_):
        bare_opt.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False,
              logits_to_keep=keep).logits.float().mean().backward()
        bare_opt.step()

    grpo_step(0), bare_step(0)
    t_grpo, t_fb = [], []
    for _ in range(args.repeats):
        t_grpo += timed(grpo_step, 1)
        t_fb += timed(bare_step, 1)
    g, b = statistics.median(t_grpo), statistics.median(t_fb)
    print("\n## 3. GRPO step vs bare forward+backward+Adam (same tokens)")
    print(f"  grpo step {g:7.3f}s   bare {b:7.3f}s   ratio {g / b:.3f} (target <= 1.2; {len(seqs)} sequences, "
          f"{int(attn.sum())} tokens)")


if __name__ == "__main__":
    main()
