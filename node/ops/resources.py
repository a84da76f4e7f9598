"""How much memory a peer needs, and whether N peers fit on this machine (CPU RAM or one GPU).

Estimate per peer = parameters x (weights + gradients + Adam's two moments) + an activation allowance
+ the runtime's fixed overhead. Weights are fp32 on CPU and bf16 on GPU (Adam state stays fp32-sized for
safety); on a CPU the default rollout engine (llama.cpp) holds its own bf16 copy of the weights. A LoRA peer
trains an adapter only: weights, activations and overhead. Peers may run different models (a mixed swarm):
each is sized by its own. Used by scripts/local_swarm.sh to refuse to start peers that would run out of memory.

    python -m node.ops.resources --model default --peers 5
    python -m node.ops.resources --models default,default,default,gemma3-270m,gemma3-270m -- --rounds 30

Arguments after `--` are the peers' own sapo-node arguments: without `--lora-rank`, the check sizes the peers
by the rank those arguments resolve to as the node resolves it (flags, SAPO_* variables, config file, recipe:
LoRA rank 8 under the CPU recipe).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

GIB = 1024**3
# torch + transformers + hivemind; on a GPU also the CUDA context and the caching allocator's slack
RUNTIME_OVERHEAD = {"cpu": int(0.9 * GIB), "cuda": int(1.0 * GIB)}
# activations of a micro-batch, relative to the (bf16 on a GPU) weights: short sequences on a CPU (micro-batch 2);
# on a GPU micro-batch 8 and the paper mix's long completions. Measured on an H100 with 5 peers of the default
# model (docs/data/gpu-check-h100, nvidia-smi): 2.6 GB a peer for the default recipe (LoRA, cpu-learn), 6.9 GB
# for full fine-tuning on the paper mix; this estimate gives 4.6 and 6.5.
ACTIVATION_FACTOR = {"cpu": 1.0, "cuda": 12.0}
ENGINE_BYTES = {"cpu": 2, "cuda": 0}  # per parameter: the rollout engine's copy (`auto`: llama.cpp, bf16, on a CPU)


def count_parameters(model: str) -> int:
    """Parameter count without loading weights: GGUF tensor shapes, or the HF config on the meta device."""
    from node.learn.packaged import PACKAGED, model_path

    if model in ("tiny-random", "tiny-random-smol"):
        return 4_000_000 if model == "tiny-random-smol" else 200_000
    path = model_path(model) if model in PACKAGED else Path(model)
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        return int(sum(int(t.n_elements) for t in reader.tensors))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in meta.parameters())


def peer_bytes(n_params: int, device: str, lora: bool = False) -> int:
    """Full fine-tuning keeps fp32 weights, gradients and Adam's m and v (the masters, node/learn/model_io.py);
    a LoRA base is frozen, stored in bf16 on a GPU (mixed precision); activations are bf16 on a GPU."""
    half = 2 if device == "cuda" else 4
    per_param = (half if lora else 4 + 4 + 8) + ENGINE_BYTES[device]  # weights (+ grads, Adam m+v); engine
    return int(n_params * per_param + n_params * half * ACTIVATION_FACTOR[device] + RUNTIME_OVERHEAD[device])


def free_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free)
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemFree", 0))


def node_lora_rank(node_args: list[str], model: str = "default") -> int:
    """The LoRA rank a sapo-node of `model` with these arguments (and this environment) trains with (the
    recipe depends on the model on a GPU); 0 (the larger, full fine-tuning estimate) when they do not parse,
    which the peers themselves will then say."""
    from node.ops.config import ConfigError, load_config

    env = {k: v for k, v in os.environ.items() if k != "SAPO_PEERS"}  # local_swarm.sh's peer count, not maddrs
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return load_config(["--model", model, *node_args], env).lora_rank
    except (ConfigError, SystemExit):
        print("memory check: the peers' arguments do not parse; sized as full fine-tuning", file=sys.stderr)
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check that N peers of a model (or one per listed model) fit in memory.")
    ap.add_argument("--model", default="default")
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--models", default="", help="comma list, one model per peer (overrides --model and --peers)")
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="> 0: peers train a LoRA adapter (no full "
        "gradients/Adam); default: the rank the peers' arguments after -- resolve to",
    )
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("node_args", nargs=argparse.REMAINDER, help="-- then the peers' sapo-node arguments")
    args = ap.parse_args(argv)
    node_args = args.node_args[1:] if args.node_args[:1] == ["--"] else args.node_args
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = "cuda" if device.startswith("cuda") else "cpu"
    models = [m.strip() for m in args.models.split(",") if m.strip()] or [args.model] * args.peers
    need = 0
    for model in dict.fromkeys(models):  # each distinct model once, in order
        try:
            n_params = count_parameters(model)
        except Exception as exc:
            print(f"memory check: cannot size model {model!r} ({exc}); skipping the check", file=sys.stderr)
            return 0
        rank = args.lora_rank if args.lora_rank is not None else node_lora_rank(node_args, model)
        need_one, count = peer_bytes(n_params, device, lora=rank > 0), models.count(model)
        need += need_one * count
        print(
            f"memory check: {count} peers x {need_one / GIB:.2f} GiB ({model}: {n_params / 1e6:.0f}M params, "
            f"{device}{', LoRA' if rank > 0 else ''})"
        )
    free = free_bytes(device)
    where = "GPU" if device == "cuda" else "RAM"
    print(f"memory check: {len(models)} peers need {need / GIB:.1f} GiB, {free / GIB:.1f} GiB {where} free")
    if need > free:
        print(f"memory check: not enough {where}: run fewer peers (SAPO_PEERS) or a smaller model", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
