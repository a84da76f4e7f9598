"""Mixed precision for a node's model work: matmuls in bfloat16 under `torch.autocast`, everything else fp32.

On a CPU with native bf16 instructions (AVX512-BF16 or AMX: Zen 4 and later, Sapphire Rapids and later)
oneDNN runs bf16 matmuls at two to four times the fp32 rate, and training a 135M model is matmuls. The
master weights, Adam's state, gradients, the softmax over the vocabulary and the loss stay float32 (autocast
keeps reductions and `log_softmax` in fp32), so only the matmul inputs are rounded to bf16's 8 bits of
mantissa, as in every mixed-precision recipe. Measured on the default model, one thread
(docs/benchmarks/rollout-engine.md, "Mixed precision"): a training pass 3.5x faster, torch sampling 1.6x.

What it changes for GRPO: log-probs of the same tokens differ between an incremental decode and a full
forward by bf16 rounding (~1e-2 nats), so under mixed precision the torch sampler's recorded behaviour
log-probs are not used as pi_old; the update forms pi_old with its own forward, exactly as for a rollout
engine (node/learn/engines/). On a CPU without native bf16, autocast would emulate it and run slower than
fp32: `auto` picks fp32 there. On CUDA `auto` is bf16 wherever the GPU computes in it (Ampere and later): the
model is loaded in fp32 there too (node/learn/model_io.py), because weights *stored* in bf16 lose Adam's
updates: at the paper's lr 1e-6 a step moves a weight of ~0.03 by ~1e-6, under half of bf16's spacing there
(~1.2e-4), so every such update rounds away and full fine-tuning does not learn at all.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from node.learn.choices import MIXED_PRECISION


def native_bf16_cpu() -> bool:
    """Whether this CPU runs bf16 matmuls natively (oneDNN's own check: AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cuda_bf16() -> bool:
    """Whether the GPU computes in bf16 natively (compute capability 8.0 and later)."""
    if not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.3 has no emulation to leave out
        return torch.cuda.is_bf16_supported()


def resolve(mode: str, device: torch.device) -> str:
    """`bf16` or `off` for this device: `auto` is bf16 on a CPU or GPU that computes in bf16 natively, else off."""
    if mode not in MIXED_PRECISION:
        raise ValueError(f"mixed precision must be one of {MIXED_PRECISION}, not {mode!r}")
    if mode == "auto":
        native = cuda_bf16() if device.type == "cuda" else device.type == "cpu" and native_bf16_cpu()
        return "bf16" if native else "off"
    return mode


def autocast(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context every forward pass of a node runs in (its model thread enters it per job); `mode` is
    resolved (`bf16` or `off`)."""
    if mode == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


_entered = threading.local()  # per thread: the autocast contexts that `runs_under_autocast`'s hooks opened


def runs_under_autocast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every forward of `model` runs under autocast to `dtype` on its device, whoever calls it: for a model
    whose frozen weights are stored in `dtype` (`LoraBase.store_frozen_weights_as`), which a plain fp32
    forward cannot multiply. The node's model thread runs it under that autocast already (nested, it changes
    nothing there); a caller outside it (a benchmark sampling from the model a node was built on) no longer
    meets a dtype mismatch. Idempotent."""
    if getattr(model, "_sapo_autocast", None) == dtype:
        return
    model._sapo_autocast = dtype

    def enter(module: torch.nn.Module, args: tuple) -> None:
        context = torch.autocast(device_type=next(module.parameters()).device.type, dtype=dtype)
        context.__enter__()
        _entered.__dict__.setdefault("stack", []).append(context)

    def leave(module: torch.nn.Module, args: tuple, output: object) -> None:  # also when the forward raised
        _entered.stack.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


@contextlib.contextmanager
def update_attention(*models: torch.nn.Module | None) -> Iterator[None]:
    """Eager attention (matmul + softmax) for an update's passes on a CPU under bf16 autocast, PyTorch's fused
    SDPA elsewhere. On a CPU the fused kernel's backward is slow on a round's short sequences: on the default
    model (one thread, LoRA, 32 sequences of ~20 completion tokens on 66-token prompts) it took 13% of the
    update, and eager attention made the update 11% cheaper; in fp32 it did not pay (BENCHMARKS, rollout
    engine). Only the attention's arithmetic order changes, not what is computed; sampling and evaluation
    keep SDPA. Restored on exit, also when the update raises."""
    present = [m for m in models if m is not None]
    on_cpu = all(next(m.parameters()).device.type == "cpu" for m in present)
    if not (present and on_cpu and _cpu_autocast_dtype() == torch.bfloat16):
        yield
        return
    configs = {id(m.config): m.config for model in present for m in model.modules() if hasattr(m, "config")}
    switched = [c for c in configs.values() if getattr(c, "_attn_implementation", None) == "sdpa"]
    for config in switched:
        config._attn_implementation = "eager"
    try:
        yield
    finally:
        for config in switched:
            config._attn_implementation = "sdpa"


def _cpu_autocast_dtype() -> torch.dtype | None:
    """The dtype CPU autocast casts to where it is on, else None (torch before 2.4 names these calls differently)."""
    try:
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    except (TypeError, AttributeError):
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
