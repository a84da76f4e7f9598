"""Round benchmark: per-phase seconds of real rounds, and the node's two hot paths against bare baselines.

Prints these figures (measured side by side in this run, same batch, same seed):
  0. with --variants: one round's phases (sync, generate, train) for today's path (torch sampler, full
     fine-tuning, fp32) vs bf16 mixed precision alone vs the llama.cpp engine vs LoRA vs engine + LoRA
     (the last three under --mixed-precision), same tasks and seeds, interleaved, each repeat's variants
     starting from the same weights and optimizer state, for each --variant-threads setting; rewards forced
     to carry a signal so every variant trains the same 32 sequences. Wall and process-CPU seconds (on a
     shared machine read the CPU ones: one thread's CPU seconds are what an idle machine's wall clock
     would show)
  1. per-phase seconds of N solo rounds (generate, score, train, ...), from the node's own metrics
  2. generation throughput of the node's sampler (behaviour log-probs recorded) / bare model.generate
     (target >= 0.95), and the sampler's seconds with each prompt prefilled once per group vs once per
     completion (`share_prompt`)
  3. training time of one GRPO update, plain layout (each completion with its own copy of the prompt) vs
     shared prefix (each group's prompt once), beside a bare forward+backward(+Adam) over the same tokens
     in the plain layout (the targets set for it: plain/shared >= 1.6 with G = 6, >= 3 with G = 16 on cpu-easy)
  and, from the rounds of 1., the held-out evaluation's cost per round at the default cadence.

    python -m scripts.bench.round --model default --tasks cpu-easy --rounds 3 --generations 6 --json out.json
    python -m scripts.bench.round --variants --rounds 0 --skip-generation --skip-training --json fast.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from node.build import build_node
from node.learn.choices import MIXED_PRECISION
from node.learn.groups import Prompter, local_group, to_sequences
from node.learn.model_io import load_model, pick_device
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import TaskSampler, resolve_mix
from node.learn.trainer import TrainConfig, Trainer
from node.ops.config import load_config
from node.swarm.exchange import Silo


def timed(fn, repeats: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds per call; with `cpu`, also appends the process CPU seconds (all threads) of each call,
    the better figure on a machine shared with other work (it does not count time spent waiting)."""
    out = []
    for i in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(i)
        out.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
    return out


def rounds_section(args, model, tok, mix, max_new, device) -> dict:
    """1. per-phase seconds of real solo rounds; the evaluation's cost per round at --eval-every."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            [
                "--model",
                args.model,
                "--tasks",
                args.tasks,
                "--rounds",
                str(args.rounds),
                "--num-local",
                str(args.num_local),
                "--generations",
                str(args.generations),
                "--max-new-tokens",
                str(max_new),
                "--run-dir",
                run_dir,
                "--checkpoint-every",
                str(10**6),
                "--device",
                str(device),
                "--eval-every",
                str(args.eval_every),
                "--eval-size",
                str(args.eval_size),
            ],
            env={},
        )
        # a copy: a node takes its model over (the CPU recipe attaches LoRA and stores the frozen weights in
        # bf16), and figures 2 and 3 measure the model as loaded
        node = build_node(cfg, mix, copy.deepcopy(model), tok, Silo(), device)
        records = []

        async def go():
            for r in range(args.rounds):
                records.append((await node.run_round(r)).record)

        asyncio.run(go())
        node.worker.shutdown()
    phases = sorted({k for r in records for k in r["phase_s"]})
    print("\n## 1. per-phase seconds (median over rounds)")
    for p in phases:
        if p != "eval":  # only some rounds evaluate: its cost is shown below
            print(f"  {p:10s} {statistics.median(r['phase_s'].get(p, 0.0) for r in records):8.3f}")
    training_round = statistics.median(r["round_s"] - r["phase_s"].get("eval", 0.0) for r in records)
    print(f"  {'round':10s} {training_round:8.3f}  (without evaluation)")
    out = {
        "round_s": training_round,
        "phase_s": {p: statistics.median(r["phase_s"].get(p, 0.0) for r in records) for p in phases if p != "eval"},
    }
    evals = [r["eval_s"] for r in records if "eval_s" in r and "eval_repeats" not in r]  # repeats cost nothing
    if evals and args.eval_every:
        eval_s = statistics.median(evals)
        overhead = eval_s / (args.eval_every * training_round)
        print(
            f"  held-out evaluation: {eval_s:.2f}s for {args.eval_size} tasks (greedy) = {100 * overhead:.1f}% of "
            f"training time at one evaluation every {args.eval_every} rounds"
        )
        out.update(eval_s=eval_s, eval_size=args.eval_size, eval_every=args.eval_every, eval_overhead=overhead)
    return out


# name: (engine, LoRA, mixed precision); "baseline" is today's path, "fast" the node's fast path
VARIANTS = {
    "baseline": ("torch", False, False),
    "bf16": ("torch", False, True),
    "engine": ("llama", False, True),
    "lora": ("torch", True, True),
    "fast": ("llama", True, True),
}


def variants_section(args, model, tok, mix, max_new) -> dict:
    """0. one round per variant and repeat (sync + generate + score + train), same tasks and seeds."""
    from node.learn import precision
    from node.learn.engines import make_engine
    from node.learn.lora import attach
    from node.ops.config import default_lr

    mixed = precision.resolve(args.mixed_precision, torch.device("cpu"))

    adapter = attach(copy.deepcopy(model), args.lora_rank, args.lora_alpha)
    if mixed == "bf16":  # as the node does: both LoRA variants run under mixed precision
        adapter.base.store_frozen_weights_as(torch.bfloat16)
    # one trainer per model (the engine does not change what is trained): one Adam state of the full model
    # in memory, not two
    trainers = {
        lora: Trainer(
            adapter.model if lora else model,
            tok.pad_token_id,
            TrainConfig(lr=default_lr(args.lora_rank if lora else 0), micro_batch_size=args.micro_batch_size),
            adapter=adapter if lora else None,
        )
        for lora in (False, True)
    }
    setups = {}
    for name, (engine, lora, bf16) in VARIANTS.items():
        m, a = (adapter.model, adapter) if lora else (model, None)
        if a is not None:
            a.activate()
        t0, c0 = time.perf_counter(), time.process_time()
        mode = mixed if bf16 else "off"
        eng = make_engine(engine, m, tok, args.model, weight_type=args.engine_weights, logp_exact=mode == "off")
        first_sync = (time.perf_counter() - t0, time.process_time() - c0)
        setups[name] = (m, a, eng, trainers[lora], first_sync, mode)
    prompter = Prompter(tok, mix)
    scfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=max_new)
    out: dict = {
        "lora_rank": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "engine_weights": args.engine_weights,
        "engines": {n: s[2].name for n, s in setups.items()},
        "mixed_precision": {n: s[5] for n, s in setups.items()},
        "first_sync_s": {n: s[4][0] for n, s in setups.items()},
    }
    for n_setting, threads in enumerate(args.variant_threads):
        torch.set_num_threads(threads)
        phases = {
            n: {
                k: []
                for k in ("sync", "gen", "train", "round", "sync_cpu", "gen_cpu", "train_cpu", "round_cpu", "tokens")
            }
            for n in setups
        }
        sampler = TaskSampler(mix, seed=321)
        for i in range(0 if n_setting else -1, args.variant_repeats):  # -1: warm-up (first setting), not counted
            tasks = sampler.sample(args.num_local)
            prompts = [prompter(t) for t in tasks]
            start = {lora: _snapshot(t) for lora, t in trainers.items()}
            for name, (m, a, eng, trainer, _, mode) in setups.items():  # interleaved: load hits all alike
                if a is not None:
                    a.activate()
                _restore(trainer, start[a is not None])  # every variant samples from the same weights
                with precision.autocast(mode, torch.device("cpu")):  # as the node's model thread runs it
                    t0, c0 = time.perf_counter(), time.process_time()
                    if eng.name != "torch":
                        eng.sync(m)  # the weights the previous update left
                    t1, c1 = time.perf_counter(), time.process_time()
                    torch.manual_seed(3000 + i)
                    sampled = eng.sample(prompts, args.generations, scfg)
                    t2, c2 = time.perf_counter(), time.process_time()
                    groups = [local_group(t, g, mix.answer_prefix) for t, g in zip(tasks, sampled)]
                    for g in groups:  # force a signal so every variant trains every sequence
                        g.rewards = [float(j % 2) for j in range(len(g.rewards))]
                    trainer.step(to_sequences(groups, tok, prompter, scale_std=True))
                    t3, c3 = time.perf_counter(), time.process_time()
                if i >= 0:
                    ph = phases[name]
                    for key, wall, cpu in (
                        ("sync", t1 - t0, c1 - c0),
                        ("gen", t2 - t1, c2 - c1),
                        ("train", t3 - t2, c3 - c2),
                        ("round", t3 - t0, c3 - c0),
                    ):
                        ph[key].append(wall)
                        ph[key + "_cpu"].append(cpu)
                    ph["tokens"].append(sum(len(c) for g in sampled for c in g.completion_ids))
        res = {}
        for name, ph in phases.items():
            med = {k: statistics.median(v) for k, v in ph.items()}
            med["tokens_per_s"] = sum(ph["tokens"]) / sum(ph["gen"])
            med["tokens_per_cpu_s"] = sum(ph["tokens"]) / sum(ph["gen_cpu"])
            med["times"] = ph
            res[name] = med
        out[f"threads_{threads}"] = res
        base = res["baseline"]
        print(f"\n## 0. variants, {threads} thread(s), median of {args.variant_repeats} (wall s / cpu s)")
        print(
            f"  {'variant':9s} {'sync':>13s} {'generate':>13s} {'train':>13s} {'round':>13s}  tok/cpu-s  "
            "round speed-up (cpu)  gen speed-up (cpu)"
        )
        for name, r in res.items():
            print(
                f"  {name:9s} "
                + " ".join(f"{r[k]:6.2f}/{r[k + '_cpu']:6.2f}" for k in ("sync", "gen", "train", "round"))
                + f"  {r['tokens_per_cpu_s']:8.1f}  {base['round_cpu'] / r['round_cpu']:8.2f}x"
                f"  {base['gen_cpu'] / r['gen_cpu']:8.2f}x"
            )
    out["peak_rss_mb_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for _, _, eng, _, _, _ in setups.values():
        eng.close()
    return out


def _snapshot(trainer: Trainer) -> tuple[list[torch.Tensor], dict]:
    """What a trainer's update changes: its parameters and its optimizer's state."""
    return [p.detach().clone() for p in trainer.params], copy.deepcopy(trainer.optimizer.state_dict())


def _restore(trainer: Trainer, snapshot: tuple[list[torch.Tensor], dict]) -> None:
    params, optimizer = snapshot
    with torch.no_grad():
        for p, saved in zip(trainer.params, params):
            p.copy_(saved)
    trainer.optimizer.load_state_dict(copy.deepcopy(optimizer))


def generation_section(args, model, tok, prompts, scfg, max_new, device) -> dict:
    """2. generation: node sampler vs bare generate, and the sampler with and without its per-group prompt
    prefill, same prompts, same seeds."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    plen = enc["input_ids"].shape[1]
    node_tokens, unshared_tokens, bare_tokens = [], [], []

    def node_gen(i, share=True, counts=node_tokens):
        torch.manual_seed(1000 + i)
        groups = sample_groups(model, tok, prompts, args.generations, scfg, share_prompt=share)
        counts.append(sum(len(c) for g in groups for c in g.completion_ids))

    @torch.no_grad()
    def bare_gen(i):
        torch.manual_seed(1000 + i)
        model.eval()
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new,
            num_return_sequences=args.generations,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        model.train()
        gen = out[:, plen:]
        eos = tok.eos_token_id
        bare_tokens.append(sum((row.tolist().index(eos) + 1) if eos in row.tolist() else len(row) for row in gen))

    node_gen(-1), bare_gen(-1)  # warm-up
    node_tokens.clear(), bare_tokens.clear()
    t_node, t_unshared, t_bare, cpu_node, cpu_unshared = [], [], [], [], []
    for i in range(args.repeats):  # interleaved so drift hits all alike
        t_node += timed(lambda _, i=i: node_gen(i), 1, cpu_node)
        t_unshared += timed(lambda _, i=i: node_gen(i, False, unshared_tokens), 1, cpu_unshared)
        t_bare += timed(lambda _, i=i: bare_gen(i), 1)
    node_tps = sum(node_tokens) / sum(t_node)
    bare_tps = sum(bare_tokens) / sum(t_bare)
    print("\n## 2. generation throughput (tokens/s)")
    print(
        f"  node sampler {node_tps:9.1f}   bare generate {bare_tps:9.1f}   ratio {node_tps / bare_tps:.3f} "
        f"(target >= 0.95; same seeds, tokens {sum(node_tokens)} vs {sum(bare_tokens)}: the sampler stops at "
        "the chat's stop tokens, bare generate at EOS only)"
    )
    print(
        f"  each prompt prefilled once per group vs once per completion (same samples): "
        f"{sum(t_node):.1f} vs {sum(t_unshared):.1f} wall s, {sum(cpu_node):.1f} vs {sum(cpu_unshared):.1f} CPU s "
        f"({sum(cpu_unshared) / sum(cpu_node):.2f}x; tokens {sum(node_tokens)} vs {sum(unshared_tokens)})"
    )
    return {
        "sample_shared_s": t_node,
        "sample_unshared_s": t_unshared,
        "sample_shared_cpu_s": cpu_node,
        "sample_unshared_cpu_s": cpu_unshared,
        "sample_tokens": [sum(node_tokens), sum(unshared_tokens)],
        "node_tokens_per_s": node_tps,
        "bare_tokens_per_s": bare_tps,
    }


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
    ap.add_argument("--micro-batch-size", type=int, default=4, help="sequences per forward/backward (node default 4)")
    ap.add_argument("--eval-every", type=int, default=10, help="evaluation cadence the overhead is computed for")
    ap.add_argument("--eval-size", type=int, default=64)
    ap.add_argument("--skip-generation", action="store_true", help="skip figure 2 (sampler vs bare generate)")
    ap.add_argument("--skip-training", action="store_true", help="skip figure 3 (training layouts)")
    ap.add_argument("--variants", action="store_true", help="figure 0: torch/full vs engine vs LoRA vs both")
    ap.add_argument("--variant-threads", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2])
    ap.add_argument("--variant-repeats", type=int, default=2)
    ap.add_argument(
        "--train-lora", action="store_true", help="figure 3 trains a LoRA adapter (--lora-rank), not every weight"
    )
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument(
        "--engine-weights", default="auto", help="llama engine weights (auto: bf16 on a CPU with native bf16, else f16)"
    )
    ap.add_argument(
        "--mixed-precision",
        default="auto",
        choices=MIXED_PRECISION,
        help="precision of every variant but the baseline (today's path: fp32)",
    )
    ap.add_argument("--rss-json", default="", help="scripts/bench/lora.py memory JSON: its 1- and P-peer RSS")
    ap.add_argument("--json", default="", help="write the figures to this JSON file")
    args = ap.parse_args()
    result: dict = {
        "model": args.model,
        "tasks": args.tasks,
        "generations": args.generations,
        "num_local": args.num_local,
        "threads": args.threads or os.cpu_count(),
    }

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    device = pick_device(args.device)
    mix = resolve_mix(args.tasks)
    max_new = args.max_new_tokens or mix.max_new_tokens
    print(
        f"# model={args.model} device={device} threads={torch.get_num_threads()} tasks={mix.name} "
        f"I={args.num_local} G={args.generations} max_new_tokens={max_new} torch={torch.__version__}"
    )
    model, tok = load_model(args.model, device)

    if args.variants:
        v = variants_section(args, model, tok, mix, max_new)
        result["variants"] = v
        first = v[f"threads_{args.variant_threads[0]}"]
        result.update(
            baseline_gen_s=first["baseline"]["gen_cpu"],
            baseline_round_s=first["baseline"]["round_cpu"],
            fast_gen_s=first["fast"]["gen_cpu"],
            fast_round_s=first["fast"]["round_cpu"],
            baseline_gen_wall_s=first["baseline"]["gen"],
            baseline_round_wall_s=first["baseline"]["round"],
            fast_gen_wall_s=first["fast"]["gen"],
            fast_round_wall_s=first["fast"]["round"],
            timing="process CPU seconds (one thread: what an idle machine's wall clock shows)",
            rss_mb_1_peer=None,
            rss_mb_5_peers=None,
        )
        if args.rss_json:
            rss = json.loads(Path(args.rss_json).read_text())
            result.update({k: rss[k] for k in rss if k.startswith("rss_mb")})
        torch.set_num_threads(args.threads or os.cpu_count() or 1)

    # 1. real rounds through the node's loop (silo), held-out evaluation at the node's cadence
    if args.rounds > 0:
        result.update(rounds_section(args, model, tok, mix, max_new, device))

    prompter = Prompter(tok, mix)
    tasks = TaskSampler(mix, seed=123).sample(args.num_local)
    prompts = [prompter(t) for t in tasks]
    scfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=max_new)
    if not args.skip_generation:
        result.update(generation_section(args, model, tok, prompts, scfg, max_new, device))

    if args.skip_training:
        _write(args, result)
        return
    # 3. training: plain layout vs shared prefix vs a bare forward+backward over the same tokens
    sampled = sample_groups(model, tok, prompts, args.generations, scfg)
    groups = [local_group(t, s, mix.answer_prefix) for t, s in zip(tasks, sampled)]
    for g in groups:  # force a signal so every sequence trains
        g.rewards = [float(i % 2) for i in range(len(g.rewards))]
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    micro = args.micro_batch_size
    train_model, adapter = model, None
    if args.train_lora:  # what a LoRA node trains: the prompt's saving is then most of the body's work
        from node.learn.lora import attach

        adapter = attach(copy.deepcopy(model), args.lora_rank, args.lora_alpha)
        train_model = adapter.model
    trainers = {
        mode: Trainer(
            train_model,
            tok.pad_token_id,
            TrainConfig(lr=1e-7, micro_batch_size=micro, prefix_sharing=mode),
            adapter=adapter,
        )
        for mode in ("off", "on")
    }
    from node.learn.sampling import pad_batch

    batches = [pad_batch(seqs[i : i + micro], tok.pad_token_id, device) for i in range(0, len(seqs), micro)]
    bare_opt = torch.optim.Adam(trainers["off"].params, lr=1e-7, foreach=False)  # what the trainers update

    def bare_step(_):
        bare_opt.zero_grad(set_to_none=True)
        for ids, attn, positions, comp_ids, _ in batches:
            train_model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=comp_ids.shape[1] + 1,
            ).logits.float().mean().backward()
        bare_opt.step()

    steps = {
        "plain": lambda _: trainers["off"].step(seqs),
        "shared": lambda _: trainers["on"].step(seqs),
        "bare": bare_step,
    }
    for fn in steps.values():
        fn(0)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):  # interleaved so drift and other load hit all three alike
        for name, fn in steps.items():
            times[name] += timed(fn, 1, cpu[name])
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    n_tokens = sum(len(x.prompt_ids) + len(x.completion_ids) for x in seqs)
    prompt_tokens = sum(len(x.prompt_ids) for x in seqs)
    print(
        f"\n## 3. training step ({f'LoRA rank {args.lora_rank}' if adapter else 'full fine-tuning'}), "
        f"same {len(seqs)} sequences ({n_tokens} tokens, "
        f"{100 * prompt_tokens / n_tokens:.0f}% prompt), micro-batch {micro}, median of {args.repeats}"
    )
    print(f"  {'plain':>8} {'shared':>8} {'bare f+b':>9}   speed-up   shared/bare")
    for label, m in (("wall", med), ("cpu", med_cpu)):
        print(
            f"  {m['plain']:7.3f}s {m['shared']:7.3f}s {m['bare']:8.3f}s   {m['plain'] / m['shared']:7.2f}x   "
            f"{m['shared'] / m['bare']:7.2f}   ({label} seconds)"
        )
    result.update(
        train_plain_s=med["plain"],
        train_shared_s=med["shared"],
        fwd_bwd_bare_s=med["bare"],
        speedup=med["plain"] / med["shared"],
        sequences=len(seqs),
        tokens=n_tokens,
        train_lora_rank=args.lora_rank if adapter else 0,
        prompt_tokens=prompt_tokens,
        micro_batch_size=micro,
        repeats=args.repeats,
        train_times_s=times,
        train_cpu_s=cpu,
        train_plain_cpu_s=med_cpu["plain"],
        train_shared_cpu_s=med_cpu["shared"],
        fwd_bwd_bare_cpu_s=med_cpu["bare"],
        speedup_cpu=med_cpu["plain"] / med_cpu["shared"],
    )
    _write(args, result)


def _write(args, result: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
