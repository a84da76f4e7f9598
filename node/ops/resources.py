"""How much memory a peer needs, and whether N peers fit on this machine (CPU RAM or one GPU).

Estimate per peer = parameters x (weights + gradients + Adam's two moments) + an activation allowance
+ the runtime's fixed overhead. Weights are fp32 on CPU and bf16 on GPU (Adam state stays fp32-sized for
safety); on a CPU the default rollout engine (llama.cpp) holds its own bf16 copy of the weights. Used by
scripts/local_swarm.sh to refuse to start peers that would run out of memory.

    python -m node.ops.resources --model default --peers 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

GIB = 1024**3
RUNTIME_OVERHEAD = {"cpu": int(0.9 * GIB), "cuda": int(0.6 * GIB)}  # torch + transformers + hivemind
ACTIVATION_FACTOR = 1.0  # activations for a micro-batch of short sequences, relative to the weights
ENGINE_BYTES = {"cpu": 2, "cuda": 0}  # per parameter: the rollout engine's copy (`auto`: llama.cpp, bf16, on a CPU)


def count_parameters(model: str) -> int:
    """Parameter count without loading weights: GGUF tensor shapes, or the HF config on the meta device."""
    from node.learn.policy import embedded_model_path

    if model in ("tiny-random", "tiny-random-smol"):
        return 4_000_000 if model == "tiny-random-smol" else 200_000
    path = embedded_model_path() if model == "default" else Path(model)
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


def peer_bytes(n_params: int, device: str) -> int:
    weight = 2 if device == "cuda" else 4
    per_param = weight + weight + 8 + ENGINE_BYTES[device]  # weights, gradients, Adam m and v (fp32), engine
    return int(n_params * per_param + n_params * weight * ACTIVATION_FACTOR + RUNTIME_OVERHEAD[device])


def free_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free)
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemFree", 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check that N peers of a model fit in memory.")
    ap.add_argument("--model", default="default")
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = "cuda" if device.startswith("cuda") else "cpu"
    try:
        n_params = count_parameters(args.model)
    except Exception as exc:
        print(f"memory check: cannot size model {args.model!r} ({exc}); skipping the check", file=sys.stderr)
        return 0
    need_one = peer_bytes(n_params, device)
    need, free = need_one * args.peers, free_bytes(device)
    where = "GPU" if device == "cuda" else "RAM"
    print(f"memory check: {args.peers} peers x {need_one / GIB:.2f} GiB ({n_params / 1e6:.0f}M params, {device}) "
          f"= {need / GIB:.1f} GiB needed, {free / GIB:.1f} GiB {where} free")
    if need > free:
        print(f"memory check: not enough {where}: run fewer peers (SAPO_PEERS) or a smaller model", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
