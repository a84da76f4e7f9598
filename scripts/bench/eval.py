r"""The held-out evaluation's greedy decoding, two ways side by side in one run (docs/BENCHMARKS.md):

  generate  `model.generate` on batches of 32 prompts: every row decodes until the batch's longest answer
            ends (the node's evaluation before this benchmark)
  rows      `greedy_rows`: a row that stops leaves its batch, its KV-cache rows with it (the node's torch
            evaluation now, at --batches sizes)
  fp32      with --fp32: `rows` at the first batch size outside mixed precision (the reference where the
            others run under bf16 autocast, as the node's torch evaluation does on a CPU with native bf16)
  llama     with --engine llama: the rollout engine's greedy decoding (`LlamaEngine.greedy`, --engine-weights),
            what --eval-engine auto evaluates with where llama.cpp samples (docs/EVALUATION.md)

Same prompts (the preset's held-out set and its unseen set), same greedy answers expected: it prints the
seconds of each (median of --repeats, interleaved; wall and CPU), the ratio to `generate`, the accuracy,
and how many texts differ from `generate`'s (and from fp32's). --adapter takes a LoRA checkpoint (a peer's
checkpoints/round-N): a trained adapter writes longer answers than the base model, which is where the
rows that leave pay. Under mixed precision the adapter's base is stored in bf16, as a LoRA node keeps it
(its weights are then not cast again in every decoding step); the fp32 variant decodes an fp32 copy.

    nice python -m scripts.bench.eval --adapter runs/.../peer0/checkpoints/round-000009 --json eval.json
    nice python -m scripts.bench.eval --batches 64 --fp32 --engine llama --json evaluators.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from node.learn import precision
from node.learn.evaluate import greedy_texts, scored
from node.learn.groups import Prompter
from node.learn.lora import LoraBase, LoraSettings
from node.learn.model_io import load_model
from node.learn.tasks import eval_tasks, resolve_mix
from node.ops.checkpoint import load_from


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", default="cpu-learn")
    ap.add_argument("--size", type=int, default=128, help="held-out tasks (and as many unseen ones)")
    ap.add_argument("--adapter", default="", help="a LoRA checkpoint to evaluate (default: the base model)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--batches", default="32,64,128", help="batch sizes of the `rows` variant")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fp32", action="store_true", help="add `rows` outside mixed precision (the reference)")
    ap.add_argument("--engine", default="", choices=("", "llama"), help="add the rollout engine's greedy decoding")
    ap.add_argument("--engine-weights", default="auto")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    model, tok = load_model(args.model, device)
    mode = precision.resolve("auto", device)
    reference = model  # what the fp32 variant decodes
    if args.adapter:
        state = load_from(Path(args.adapter)).model

        def with_adapter(base: torch.nn.Module, stored: torch.dtype) -> torch.nn.Module:
            adapter = LoraBase(base, LoraSettings(args.lora_rank, args.lora_alpha)).adapter("bench")
            adapter.load_state_dict(state)
            if stored != torch.float32:  # as a LoRA node keeps its base under bf16 (node/build.py)
                adapter.base.store_frozen_weights_as(stored)
            return adapter.model

        mixed = mode == "bf16"
        fp32_base = copy.deepcopy(model) if mixed and args.fp32 else None  # before PEFT wraps `model` in place
        model = with_adapter(model, torch.bfloat16 if mixed else torch.float32)
        reference = model if fp32_base is None else with_adapter(fp32_base, torch.float32)
    mix = resolve_mix(args.tasks)
    tasks = eval_tasks(mix, args.size) + eval_tasks(mix, args.size, unseen=True)
    prompter = Prompter(tok, mix)
    prompts = [prompter(t) for t in tasks]
    batches = [int(b) for b in args.batches.split(",")]

    def torch_greedy(batch: int, compact: bool, how: str = mode):
        def run() -> list[str]:
            with precision.autocast(how, device):
                return greedy_texts(
                    model if how == mode else reference, tok, prompts, mix.max_new_tokens, batch, compact=compact
                )

        return run

    variants = {"generate-32": torch_greedy(32, False)} | {f"rows-{b}": torch_greedy(b, True) for b in batches}
    if args.fp32:
        variants["fp32"] = torch_greedy(batches[0], True, "off")
    engine = None
    if args.engine:
        from node.learn.engines import make_engine

        engine = make_engine(args.engine, model, tok, args.model, weight_type=args.engine_weights)
        if engine.name != args.engine:
            raise SystemExit(f"the {args.engine} engine is not available here")
        variants[f"{args.engine}-{engine.weight_type}"] = lambda: engine.greedy(prompts, mix.max_new_tokens)

    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    texts: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for name, run in variants.items():
            w, c = time.perf_counter(), time.process_time()
            texts[name] = run()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    if engine is not None:
        engine.close()

    ref = texts["generate-32"]
    out = {
        "model": args.model,
        "tasks": args.tasks,
        "prompts": len(prompts),
        "adapter": args.adapter,
        "threads": args.threads,
        "mixed_precision": mode,
        "load_average": os.getloadavg()[0],
        "variants": {},
    }
    print(
        f"{len(prompts)} prompts ({args.tasks}, {args.adapter or 'base model'}), {args.threads} thread(s), "
        f"median of {args.repeats}"
    )
    for name in variants:
        row = {
            "wall_s": statistics.median(wall[name]),
            "cpu_s": statistics.median(cpu[name]),
            "differ": sum(a != b for a, b in zip(ref, texts[name])),
            "accuracy": scored(tasks, texts[name], prompter).accuracy,
        }
        if "fp32" in texts:
            row["differ_fp32"] = sum(a != b for a, b in zip(texts["fp32"], texts[name]))
        row["speedup_cpu"] = out["variants"].get("generate-32", row)["cpu_s"] / row["cpu_s"]
        out["variants"][name] = row
        print(
            f"  {name:12s} wall {row['wall_s']:6.1f} s  cpu {row['cpu_s']:6.1f} s  x{row['speedup_cpu']:.2f} (CPU)"
            f"  accuracy {row['accuracy']:.3f}  texts differing from generate {row['differ']}/{len(prompts)}"
            + (f", from fp32 {row['differ_fp32']}" if "differ_fp32" in row else "")
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
