"""Is a node's held-out evaluation a pure function of its weights? Evaluates exported LoRA weights (a
checkpoint or an `export_weights` copy) as a node does, in a fresh process, and compares the greedy answers,
one by one, with what the run that wrote them recorded at that round. `--shared` puts every adapter on one
base, as memory mode does; `--precision off` evaluates in fp32 instead of the node's mode on this CPU.

    nice python -m scripts.research.eval_adapters docs/data/newcomer-veterans/4-0/seed{0,1,2,3} --shared

Each DIR holds `adapter/` and `peer0/metrics.jsonl` (a veterans cell); the record compared is that of the
checkpoint's round. RESULTS 8 (the round-0 question) quotes its output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from node.learn import precision
from node.learn.evaluate import HeldOutEval
from node.learn.groups import Prompter
from node.learn.lora import LoraBase, LoraSettings
from node.learn.model_io import load_model
from node.learn.tasks import resolve_mix
from node.ops.checkpoint import load_from
from node.ops.metrics import read_records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", nargs="+", type=Path, help="cell dirs, each with adapter/ and peer0/metrics.jsonl")
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", default="cpu-learn")
    ap.add_argument("--eval-size", type=int, default=128)
    ap.add_argument("--shared", action="store_true", help="all adapters on one base (memory mode)")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "off"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    mode = precision.resolve(args.precision, cpu)
    mix = resolve_mix(args.tasks)
    checkpoints = [load_from(cell / "adapter") for cell in args.cells]
    lora = (checkpoints[0].meta or {}).get("lora")
    if not lora or any((c.meta or {}).get("lora") != lora for c in checkpoints):
        ap.error("every cell's adapter/ must hold LoRA weights of the same rank and alpha")

    def base() -> tuple[LoraBase, object]:
        model, tokenizer = load_model(args.model, cpu)
        return LoraBase(model, LoraSettings(lora["rank"], lora["alpha"])), tokenizer

    shared = base() if args.shared else None
    adapters = []
    for i, ckpt in enumerate(checkpoints):
        lora_base, tokenizer = shared or base()
        adapter = lora_base.adapter(f"peer{i}")
        if mode == "bf16":  # per adapter, as build_node does (a no-op on a base cast already)
            lora_base.store_frozen_weights_as(torch.bfloat16)
        adapter.load_state_dict(ckpt.model)
        adapters.append((adapter, tokenizer))
    mismatches = 0
    for cell, ckpt, (adapter, tokenizer) in zip(args.cells, checkpoints, adapters):
        adapter.activate()
        with precision.autocast(mode, cpu):
            result = HeldOutEval(mix, args.eval_size, 1, 1).run(
                adapter.model, tokenizer, Prompter(tokenizer, mix), mix.max_new_tokens
            )
        records = [r for r in read_records(cell / "peer0" / "metrics.jsonl") if r.get("round") == ckpt.round]
        if not records or "eval_answers" not in records[-1]:
            ap.error(f"{cell}/peer0/metrics.jsonl has no evaluation of round {ckpt.round}, the adapter's round")
        record = records[-1]  # a resumed run's last line of a round is the one that counts
        line = [f"{cell}: round {ckpt.round} ({mode}{', shared base' if args.shared else ''})"]
        for key, res in (("eval", result), ("eval_unseen", result.unseen)):
            if res is None:
                continue
            same = sum(a == b for a, b in zip(res.answers, record[f"{key}_answers"]))
            mismatches += len(res.answers) - same
            line.append(
                f"{key} {res.accuracy:.4f} (recorded {record[f'{key}_accuracy']:.4f}; "
                f"{same}/{len(res.answers)} answers the same)"
            )
        print(" | ".join(line), flush=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
