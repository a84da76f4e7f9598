"""LoRA figures for docs/BENCHMARKS.md, each measured side by side in one run.

  train   one GRPO update (the node's layout: shared prefix when the model allows it) and one sampling
          pass over the same prompts with the same seeds: full fine-tuning vs a LoRA adapter of each
          rank, on copies of the same model, interleaved so other load hits every variant alike
  memory  peak RSS of a memory-mode experiment (`sapo-experiment --mode memory`) with 1 and with P LoRA
          peers, each run in its own process (LoRA peers share one base model); optionally full fine-tuning
          peers for reference

    python -m scripts.bench.lora train --model default --tasks cpu-easy --generations 8 --threads 1 --ranks 1,8
    python -m scripts.bench.lora memory --model default --peers 5 --rounds 2 --json out.json

`lora_vs_full(...)` is the function other benchmarks call for the training/sampling comparison.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from node.learn.groups import Prompter, local_group, to_sequences
from node.learn.lora import attach
from node.learn.model_io import load_model, pick_device
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import TaskSampler, resolve_mix
from node.learn.trainer import TrainConfig, Trainer

REPO = Path(__file__).resolve().parents[2]


def lora_vs_full(
    model,
    tok,
    prompts: list[str],
    seqs,
    scfg: SamplingConfig,
    generations: int,
    ranks: list[int],
    alpha: float = 32.0,
    repeats: int = 3,
    micro_batch_size: int = 4,
) -> dict:
    """Median seconds of one GRPO update (`train_<variant>_s`) and of sampling `generations` completions per
    prompt (`gen_<variant>_s`), each also in process CPU seconds (`..._cpu_s`: the figure to read on a
    machine shared with other work), variants `full` and `lora_r<rank>`; the
    trainable parameter count of each (`params_<variant>`). LoRA variants run on deep copies of `model`."""
    variants = {"full": (model, None)}
    for r in ranks:
        a = attach(copy.deepcopy(model), r, alpha)
        variants[f"lora_r{r}"] = (a.model, a)
    trainers = {
        name: Trainer(m, tok.pad_token_id, TrainConfig(lr=1e-7, micro_batch_size=micro_batch_size), adapter=a)
        for name, (m, a) in variants.items()
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    gen: dict[str, list[float]] = {k: [] for k in variants}
    gen_cpu: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, int] = {k: 0 for k in variants}
    for i in range(-1, repeats):  # i = -1: warm-up, not counted
        for name, (m, _) in variants.items():  # interleaved: drift and other load hit every variant alike
            t0, c0 = time.perf_counter(), time.process_time()
            trainers[name].step(seqs)
            t1, c1 = time.perf_counter(), time.process_time()
            torch.manual_seed(2000 + i)
            groups = sample_groups(m, tok, prompts, generations, scfg)
            t2, c2 = time.perf_counter(), time.process_time()
            if i >= 0:
                times[name].append(t1 - t0)
                cpu[name].append(c1 - c0)
                gen[name].append(t2 - t1)
                gen_cpu[name].append(c2 - c1)
                tokens[name] += sum(len(c) for g in groups for c in g.completion_ids)
    out: dict = {
        "ranks": ranks,
        "alpha": alpha,
        "repeats": repeats,
        "sequences": len(seqs),
        "train_times_s": times,
        "train_cpu_times_s": cpu,
        "gen_times_s": gen,
        "gen_cpu_times_s": gen_cpu,
    }
    for name, (m, a) in variants.items():
        out[f"train_{name}_s"] = statistics.median(times[name])
        out[f"train_{name}_cpu_s"] = statistics.median(cpu[name])
        out[f"gen_{name}_s"] = statistics.median(gen[name])
        out[f"gen_{name}_cpu_s"] = statistics.median(gen_cpu[name])
        out[f"gen_{name}_tokens_per_s"] = tokens[name] / sum(gen[name])
        out[f"params_{name}"] = a.num_parameters() if a is not None else sum(p.numel() for p in m.parameters())
        if a is not None:  # what a checkpoint's model.pt + optimizer.pt hold (the full model's: scripts/bench/stop.py)
            buf = io.BytesIO()
            torch.save({"model": a.state_dict(), "optimizer": trainers[name].optimizer.state_dict()}, buf)
            out[f"checkpoint_mb_{name}"] = buf.tell() / 2**20
    return out


def signal_sequences(model, tok, mix, num_local: int, generations: int, scfg: SamplingConfig, seed: int = 123):
    """(prompts, training sequences) of `num_local` sampled groups, rewards forced to carry a signal so
    every sequence trains (a weak model often earns nothing)."""
    prompter = Prompter(tok, mix)
    tasks = TaskSampler(mix, seed=seed).sample(num_local)
    prompts = [prompter(t) for t in tasks]
    sampled = sample_groups(model, tok, prompts, generations, scfg)
    groups = [local_group(t, s, mix.answer_prefix) for t, s in zip(tasks, sampled)]
    for g in groups:
        g.rewards = [float(i % 2) for i in range(len(g.rewards))]
    return prompts, to_sequences(groups, tok, prompter, scale_std=True)


def train_cmd(args) -> dict:
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    device = pick_device(args.device)
    mix = resolve_mix(args.tasks)
    scfg = SamplingConfig(max_new_tokens=args.max_new_tokens or mix.max_new_tokens)
    model, tok = load_model(args.model, device)
    prompts, seqs = signal_sequences(model, tok, mix, args.num_local, args.generations, scfg)
    ranks = [int(r) for r in args.ranks.split(",") if r]
    res = lora_vs_full(
        model, tok, prompts, seqs, scfg, args.generations, ranks, args.lora_alpha, args.repeats, args.micro_batch_size
    )
    tok_total = sum(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
    print(
        f"# model={args.model} threads={torch.get_num_threads()} tasks={mix.name} I={args.num_local} "
        f"G={args.generations} sequences={len(seqs)} tokens={tok_total} median of {args.repeats}"
    )
    print(
        f"  {'variant':10s} {'train s':>8} {'cpu s':>7} {'vs full':>8} {'sample s':>9} {'cpu s':>7} {'vs full':>8}"
        "  params   (vs full: ratio of CPU seconds)"
    )
    for name in ["full"] + [f"lora_r{r}" for r in ranks]:
        print(
            f"  {name:10s} {res[f'train_{name}_s']:8.2f} {res[f'train_{name}_cpu_s']:7.2f} "
            f"{res['train_full_cpu_s'] / res[f'train_{name}_cpu_s']:7.2f}x {res[f'gen_{name}_s']:9.2f} "
            f"{res[f'gen_{name}_cpu_s']:7.2f} {res['gen_full_cpu_s'] / res[f'gen_{name}_cpu_s']:7.2f}x"
            f"  {res[f'params_{name}']:,}"
        )
    return {
        "model": args.model,
        "tasks": args.tasks,
        "generations": args.generations,
        "num_local": args.num_local,
        "threads": torch.get_num_threads(),
        "tokens": tok_total,
        **res,
    }


def peak_rss_mb(cmd: list[str], env: dict) -> float:
    """Peak resident size of `cmd` (and anything it waited for), in its own measuring process."""
    probe = (
        "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0 if rc == 0 else -rc)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, capture_output=True, text=True, check=True)
    value = float(out.stdout.strip().splitlines()[-1])
    if value <= 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {-value:.0f}): {out.stderr[-2000:]}")
    return value


def memory_cmd(args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = {
        "model": args.model,
        "tasks": args.tasks,
        "rounds": args.rounds,
        "lora_rank": args.lora_rank,
        "threads": args.threads,
        "preset": args.preset,
        "node_args": args.node_arg,
    }
    kinds = [("lora", ["--lora-rank", str(args.lora_rank)])]
    kinds += [("full", ["--lora-rank", "0"])] if args.full_too else []  # said: on a CPU the recipe would pick LoRA
    with tempfile.TemporaryDirectory() as tmp:
        for kind, extra in kinds:
            for peers in (1, args.peers):
                cmd = [
                    sys.executable,
                    "-m",
                    "node.lab.experiment",
                    args.preset,
                    "--mode",
                    "memory",
                    "--peers",
                    str(peers),
                    "--rounds",
                    str(args.rounds),
                    "--seeds",
                    "0",
                    "--model",
                    args.model,
                    "--tasks",
                    args.tasks,
                    "--threads",
                    str(args.threads),
                    "--eval-every",
                    "0",
                    "--out",
                    f"{tmp}/{kind}{peers}",
                    *extra,
                    *(f"--node-arg={a}" for a in args.node_arg),
                ]
                t0 = time.time()
                rss = peak_rss_mb(cmd, env)
                key = f"rss_mb_{peers}_peer{'s' if peers > 1 else ''}"
                result[key if kind == "lora" else f"full_{key}"] = round(rss, 1)
                print(f"  {kind:5s} {peers} peer(s): peak RSS {rss:8.1f} MB ({time.time() - t0:.0f} s)", flush=True)
    result["rss_ratio"] = result[f"rss_mb_{args.peers}_peers"] / result["rss_mb_1_peer"]
    print(f"  {args.peers} LoRA peers / 1: {result['rss_ratio']:.2f}x (target <= 2)")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train", help="one GRPO update and one sampling pass: full vs LoRA ranks")
    t.add_argument("--ranks", default="1,8")
    t.add_argument("--lora-alpha", type=float, default=32.0)
    t.add_argument("--num-local", type=int, default=4)
    t.add_argument("--generations", type=int, default=8)
    t.add_argument("--max-new-tokens", type=int, default=0)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--micro-batch-size", type=int, default=4)
    t.add_argument("--device", default="auto")
    m = sub.add_parser("memory", help="peak RSS of memory-mode experiments with 1 and P LoRA peers")
    m.add_argument("--peers", type=int, default=5)
    m.add_argument("--rounds", type=int, default=2)
    m.add_argument("--preset", default="2/2", help="sapo-experiment preset (its peer count is overridden)")
    m.add_argument("--lora-rank", type=int, default=8)
    m.add_argument("--full-too", action="store_true", help="also full fine-tuning peers (5 x ~2 GB)")
    m.add_argument(
        "--node-arg",
        action="append",
        default=[],
        help="passed on to every peer, e.g. --node-arg=--rollout-engine=llama (repeatable)",
    )
    for p in (t, m):
        p.add_argument("--model", default="default")
        p.add_argument("--tasks", default="cpu-easy")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--json", default="", help="write the figures to this JSON file")
    args = ap.parse_args()
    result = train_cmd(args) if args.what == "train" else memory_cmd(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
