r"""The held-out evaluation's greedy decoding, two ways side by side in one run (docs/BENCHMARKS.md):

  generate  `model.generate` on batches of 32 prompts: every row decodes until the batch's longest answer
            ends (the node's evaluation before this benchmark)
  rows      `greedy_rows`: a row that stops leaves its batch, its KV-cache rows with it (the node's
            evaluation now, at --batches sizes)

Same prompts (the preset's held-out set and its unseen set), same greedy answers expected: it prints the
seconds of each (median of --repeats, interleaved; wall and CPU), the ratio to `generate`, the accuracy,
and how many texts differ from `generate`'s. --adapter takes a LoRA checkpoint (a peer's
checkpoints/round-N): a trained adapter writes longer answers than the base model, which is where the
rows that leave pay.

    nice python -m scripts.bench.eval --adapter runs/.../peer0/checkpoints/round-000009 --json eval.json
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    model, tok = load_model(args.model, device)
    if args.adapter:
        adapter = LoraBase(model, LoraSettings(args.lora_rank, args.lora_alpha)).adapter("bench")
        adapter.load_state_dict(load_from(Path(args.adapter)).model)
        adapter.activate()
        model = adapter.model
    mix = resolve_mix(args.tasks)
    tasks = eval_tasks(mix, args.size) + eval_tasks(mix, args.size, unseen=True)
    prompter = Prompter(tok, mix)
    prompts = [prompter(t) for t in tasks]
    variants = {"generate-32": (32, False)} | {f"rows-{b}": (int(b), True) for b in args.batches.split(",")}

    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    texts: dict[str, list[str]] = {}
    with precision.autocast(precision.resolve("auto", device), device):
        for _ in range(args.repeats):
            for name, (batch, compact) in variants.items():
                w, c = time.perf_counter(), time.process_time()
                texts[name] = greedy_texts(model, tok, prompts, mix.max_new_tokens, batch, compact=compact)
                wall[name].append(time.perf_counter() - w)
                cpu[name].append(time.process_time() - c)

    ref = texts["generate-32"]
    out = {"model": args.model, "tasks": args.tasks, "prompts": len(prompts), "adapter": args.adapter,
           "threads": args.threads, "load_average": os.getloadavg()[0], "variants": {}}
    print(f"{len(prompts)} prompts ({args.tasks}, {args.adapter or 'base model'}), {args.threads} thread(s), "
          f"median of {args.repeats}")
    for name in variants:
        row = {"wall_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name]),
               "differ": sum(a != b for a, b in zip(ref, texts[name])),
               "accuracy": scored(tasks, texts[name], prompter).accuracy}
        row["speedup_cpu"] = out["variants"].get("generate-32", row)["cpu_s"] / row["cpu_s"]
        out["variants"][name] = row
        print(f"  {name:12s} wall {row['wall_s']:6.1f} s  cpu {row['cpu_s']:6.1f} s  x{row['speedup_cpu']:.2f} (CPU)"
              f"  accuracy {row['accuracy']:.3f}  texts differing from generate {row['differ']}/{len(prompts)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
