"""The policy written as GGUF for llama.cpp (node/learn/engines/llama.py): full weights, or a LoRA adapter.

Llama-architecture models only. The tokenizer metadata comes from a template GGUF with the same
vocabulary (the embedded SmolLM2 file for `default` and `tiny-random-smol`): llama.cpp needs it to load a
model, though the engine only ever hands it token ids. Query and key rows are reordered from the
rotate-half layout of `transformers` to the interleaved pairs llama.cpp rotates (`rope_rows`).

A LoRA model can also be written merged (W + scale * B A per layer, `merge_lora`): llama.cpp then samples
at the base model's speed (an adapter on top doubled a decode step's graph). In bf16 the merged weights
are rounded stochastically: the frozen base already sits on the bf16 grid (node/learn/lora.py), so
round-to-nearest would drop every update smaller than half a grid step and the engine would lag the
trainer; stochastic rounding keeps each weight's expected value, W + scale * B A, exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from node.learn.choices import GGUF_WEIGHTS as WEIGHT_TYPES
from node.learn.lora import base_name
from node.learn.precision import native_bf16_cpu

LAYER_TENSORS = {  # transformers module (inside model.layers.N) -> GGUF tensor (inside blk.N)
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")


def resolve_weight_type(weight_type: str) -> str:
    """`auto`: bf16 where the CPU computes in bf16 natively (llama.cpp's bf16 kernels use it), else f16."""
    if weight_type == "auto":
        return "bf16" if native_bf16_cpu() else "f16"
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"engine weights must be auto or one of {WEIGHT_TYPES}, not {weight_type!r}")
    return weight_type


def gguf_module(name: str) -> str | None:
    """`model.layers.3.self_attn.q_proj` (PEFT wrappers stripped) -> `blk.3.attn_q`; None if not mapped."""
    name = base_name(name)
    if name in TOP_TENSORS:
        return TOP_TENSORS[name]
    m = _LAYER.match(name)
    if m and m.group(2) in LAYER_TENSORS:
        return f"blk.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"
    return None


def rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a query/key projection (or of a LoRA B) from rotate-half order (pairs i, i + d/2 of each
    head) to llama.cpp's interleaved order (pairs 2i, 2i + 1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_heads(gguf_name: str, config) -> int | None:
    if gguf_name.endswith(".attn_q"):
        return config.num_attention_heads
    if gguf_name.endswith(".attn_k"):
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return None


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_supported(model: torch.nn.Module) -> None:
    config = base_model(model).config
    if getattr(config, "model_type", "") != "llama":
        raise ValueError(f"llama.cpp export covers llama-architecture models, not {config.model_type!r}")


def template_fields(template: Path) -> list[tuple[str, object, list]]:
    """The tokenizer's key/values of a GGUF file, to copy into every file written: (key, value, types). Kept
    beside the cached models, keyed by the file: parsing them (49k tokens and merges) costs 5 CPU-s, which
    every engine start paid."""
    import gguf

    from node.learn.packaged import ENGINE_TOKENIZER, cached_json, derived_name

    def parse() -> list:
        reader = gguf.GGUFReader(str(template))
        fields = reader.fields.items()
        return [[k, f.contents(), [int(t) for t in f.types]] for k, f in fields if k.startswith("tokenizer.")]

    rows = cached_json(
        derived_name(ENGINE_TOKENIZER, template),
        parse,
        lambda v: isinstance(v, list) and all(isinstance(r, list) and len(r) == 3 for r in v),
    )
    return [(k, value, [gguf.GGUFValueType(t) for t in types]) for k, value, types in rows]


def _writer(path: Path, fields: list[tuple[str, object, list]], kind: str):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(kind)
    for key, value, types in fields:
        w.add_key_value(key, value, types[0], types[-1] if len(types) > 1 else None)
    return w


def _arch(w, config) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    rope = getattr(config, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(head_dim)


def _encode(array: np.ndarray, weight_type: str):
    """(data, raw GGML type or None) for a 2-D weight in `weight_type`; vectors always stay float32."""
    import gguf

    if array.ndim < 2 or weight_type == "f32":
        return array.astype(np.float32, copy=False), None
    if weight_type == "f16":
        return array.astype(np.float16), None
    if weight_type == "bf16":  # torch rounds to nearest even as gguf's numpy path does, 20x faster
        return _bf16_raw(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16))
    return gguf.quants.quantize(
        array.astype(np.float32, copy=False), gguf.GGMLQuantizationType.Q8_0
    ), gguf.GGMLQuantizationType.Q8_0


def _bf16_raw(t: torch.Tensor):
    """A bfloat16 tensor as GGUF's raw BF16 bytes: (uint8 array, raw type)."""
    import gguf

    return t.view(torch.int16).numpy().view(np.uint8), gguf.GGMLQuantizationType.BF16


MERGEABLE = ("bf16", "f32")  # weight types a LoRA model is written merged in (f32 exact, bf16 unbiased)


def stochastic_bf16(x: torch.Tensor, consume: bool = False) -> torch.Tensor:
    """float32 -> bfloat16 rounded up or down at random, in proportion to the distance (E[out] = x):
    random low 16 bits are added to the float32 pattern (to the magnitude, whatever the sign), then cut
    off. Infinities stay infinite (their low bits are zero and cut off again), NaN stays NaN. With
    `consume`, a contiguous float32 `x` is rounded in place (no copy; its contents are lost).

    The noise is raw PCG64 output (twice as fast as torch.randint for 100M values), seeded from torch's
    global RNG, which checkpoints hold, so a resumed node rounds as the uninterrupted one did."""
    reuse = consume and x.dtype == torch.float32 and x.is_contiguous()
    bits = (x if reuse else x.to(torch.float32, copy=True).contiguous()).view(torch.int32)
    rng = np.random.default_rng(int(torch.randint(0, 2**63 - 1, (1,))))
    bits += torch.from_numpy(np.frombuffer(rng.bytes(2 * bits.numel()), dtype=np.uint16).astype(np.int32)).view(
        bits.shape
    )
    bits &= -65536  # 0xFFFF0000 in two's complement
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def lora_deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """gguf module name -> scale * B A of the active adapter (float32, [out, in]); empty without LoRA."""
    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "active_adapters"):
            continue
        adapter = module.active_adapters[0]
        if adapter in module.lora_A and module.merged is False:
            target = gguf_module(name)
            if target is None:
                raise ValueError(f"LoRA on {name}: llama.cpp has no tensor for it")
            b, a = module.lora_B[adapter].weight.float(), module.lora_A[adapter].weight.float()
            out[target] = (b @ a) * float(module.scaling[adapter])
    return out


@torch.no_grad()
def write_model(
    path: Path,
    model: torch.nn.Module,
    fields: list,
    weight_type: str = "f16",
    merge_lora: bool = False,
    frozen: dict | None = None,
) -> Path:
    """The model's current weights as a llama.cpp model file: a PEFT model's frozen base, or with
    `merge_lora` (bf16 or f32 only) the base with its active adapter merged in.

    `frozen` (a dict the caller keeps between calls) holds the encodings of tensors no adapter touches,
    keyed by tensor identity and version, so that the LoRA base's embedding and norms are encoded once
    (an in-place update changes the version, so full fine-tuning is never served a stale copy)."""
    inner = base_model(model)
    config = inner.config
    if merge_lora and weight_type not in MERGEABLE:
        raise ValueError(f"a LoRA model is written merged only in {MERGEABLE}, not {weight_type}")
    deltas = lora_deltas(model) if merge_lora else {}
    cached, kept = dict(frozen or {}), {}
    w = _writer(path, fields, "model")
    _arch(w, config)
    for name, tensor in inner.state_dict().items():
        if "lora_" in name or not name.endswith(".weight"):
            continue
        module = gguf_module(name[: -len(".weight")])
        if module is None or (module == "output" and config.tie_word_embeddings):
            continue
        heads = _rope_heads(module, config)
        if module in deltas and weight_type == "bf16":  # straight to bf16 bits: one rounding, few passes
            merged = deltas.pop(module)
            merged += tensor.detach().cpu()
            data, raw = _bf16_raw(stochastic_bf16(merged, consume=True))
            if heads:
                data = np.ascontiguousarray(rope_rows(data, heads))
            w.add_tensor(f"{module}.weight", data, raw_dtype=raw)
            continue
        key = (name, tensor.data_ptr(), tensor._version, weight_type)
        if module not in deltas and key in cached:
            data, raw = kept[key] = cached[key]
        else:
            array = tensor.detach().cpu().float()
            if module in deltas:
                array = array + deltas[module]
            array = array.numpy()
            if heads:
                array = rope_rows(array, heads)
            data, raw = _encode(array, weight_type)
            if frozen is not None and module not in deltas:
                kept[key] = (data, raw)
        w.add_tensor(f"{module}.weight", data, raw_dtype=raw)
    if frozen is not None:  # only what this model still holds: the cache never grows past one model
        frozen.clear()
        frozen.update(kept)
    _finish(w)
    return path


@torch.no_grad()
def write_lora(path: Path, model: torch.nn.Module) -> Path:
    """A PEFT model's active LoRA adapter as a llama.cpp adapter file (float32, small, no tokenizer)."""
    config = base_model(model).config
    w = _writer(path, [], "adapter")
    w.add_string("adapter.type", "lora")
    alpha = None
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "active_adapters"):
            continue
        adapter = module.active_adapters[0]
        if adapter not in module.lora_A:
            continue
        target = gguf_module(name)
        if target is None:
            raise ValueError(f"LoRA on {name}: llama.cpp has no tensor for it")
        a = module.lora_A[adapter].weight.detach().float().cpu().numpy()  # [r, in]
        b = module.lora_B[adapter].weight.detach().float().cpu().numpy()  # [out, r]
        heads = _rope_heads(target, config)
        if heads:
            b = rope_rows(b, heads)
        scale = float(module.scaling[adapter])
        alpha = alpha if alpha is not None else scale * a.shape[0]
        if abs(scale * a.shape[0] - alpha) > 1e-6 * max(1.0, abs(alpha)):  # one alpha per file in llama.cpp
            b = b * (scale * a.shape[0] / alpha)
        w.add_tensor(f"{target}.weight.lora_a", np.ascontiguousarray(a))
        w.add_tensor(f"{target}.weight.lora_b", np.ascontiguousarray(b))
    if alpha is None:
        raise ValueError("no active LoRA adapter in this model")
    w.add_float32("adapter.lora.alpha", alpha)
    _finish(w)
    return path


_PACKED_KV: dict[tuple, bytes] = {}  # (key, id of its value) -> encoded key/value: the tokenizer's never change


def _write_kv_cached(w) -> bool:
    """The key/value section with each template field encoded once per process: the tokenizer's ~150k
    strings took 0.3 s to encode in every sync. Falls back (False) where gguf's writer internals differ."""
    import gguf

    pack, fouts, kv = getattr(w, "_pack_val", None), getattr(w, "fout", None), getattr(w, "kv_data", None)
    if pack is None or not fouts or kv is None or len(fouts) != 1:
        return False
    out = bytearray()
    for key, val in kv[0].items():
        cache_key = (key, id(val.value)) if key.startswith("tokenizer.") else None
        packed = _PACKED_KV.get(cache_key) if cache_key else None
        if packed is None:
            packed = bytes(
                pack(key, gguf.GGUFValueType.STRING, add_vtype=False)
                + pack(val.value, val.type, add_vtype=True, sub_type=val.sub_type)
            )
            if cache_key:
                _PACKED_KV[cache_key] = packed
        out += packed
    fouts[0].write(out)
    w.flush()
    w.state = gguf.gguf_writer.WriterState.KV_DATA
    return True


def _finish(w) -> None:
    w.write_header_to_file()
    if not _write_kv_cached(w):
        w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
