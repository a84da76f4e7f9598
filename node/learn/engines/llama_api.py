"""The few llama.cpp calls the llama engine makes, behind one small class per binding, so the engine runs on
whichever is installed (docs/benchmarks/rollout-engine.md, "A wheel instead of a compiler"):

- `wheel`: ik-llama-cpp-python, a binary wheel of ik_llama.cpp (a llama.cpp fork with its own CPU kernels;
  built for AVX2, no compiler needed). Its API is llama.cpp's of mid-2024 (`llama_kv_cache_*`,
  `llama_lora_adapter_*`); the package binds only part of it, the rest is declared here.
- `source`: llama-cpp-python, which compiles llama.cpp for this very CPU (AVX-512, bf16) at install time.

`binding("auto")` takes the source build where it is installed (built for this CPU) and the wheel otherwise;
ImportError when neither is. Every handle is an opaque pointer; the engine never touches a binding's types.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

BINDINGS = ("auto", "source", "wheel")


def _quiet_log(level, text, user_data) -> None:
    """llama.cpp logs every load to stderr; the node's own log says what matters."""


class _Api:
    """What both bindings share: the batch is filled and decoded the same way in either."""

    name = ""
    label = ""  # which package and version, for the log
    lib: Any  # the binding's module of llama.cpp functions
    auto_weights = ""  # what --engine-weights auto means here ("": bf16 on a CPU with native bf16, else f16)
    lora_on_top = True  # can apply a LoRA adapter on top of the weights (else LoRA is merged into them)
    _callbacks: dict[str, object] = {}  # per binding: llama.cpp keeps the callback's address for the process

    def decode(self, ctx, batch, entries: list[tuple[int, int, int, bool]], n_vocab: int) -> np.ndarray:
        """One llama_decode over (token, position, sequence, wants logits) entries; the logits wanted, in
        entry order, as a [n, vocab] float32 array."""
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want
        batch.n_tokens = len(entries)
        rc = self.lib.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
        n_out = sum(1 for e in entries if e[3])
        return np.ctypeslib.as_array(self._logits(ctx), shape=(n_out, n_vocab)).copy()

    def load_model(self, path: Path):
        params = self.lib.llama_model_default_params()
        params.n_gpu_layers = 0
        model = self.lib.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        return model

    def n_vocab(self, model) -> int:
        return self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(model))

    def new_context(self, model, n_ctx: int, n_seq: int, threads: int):
        params = self.lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        self._context_params(params)
        ctx = self.lib.llama_init_from_model(model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def _context_params(self, params) -> None:
        """Binding-specific context settings."""

    def set_threads(self, ctx, threads: int) -> None:
        self.lib.llama_set_n_threads(ctx, threads, threads)

    def batch_init(self, n_tokens: int):
        return self.lib.llama_batch_init(n_tokens, 0, 1)

    def batch_free(self, batch) -> None:
        self.lib.llama_batch_free(batch)

    def free_context(self, ctx) -> None:
        self.lib.llama_free(ctx)

    # what each binding does its own way
    def _logits(self, ctx) -> Any:
        raise NotImplementedError

    def clear(self, ctx) -> None:
        raise NotImplementedError

    def seq_cp(self, ctx, src: int, dst: int) -> None:
        raise NotImplementedError

    def load_adapter(self, model, path: Path) -> Any:
        raise NotImplementedError

    def apply_adapter(self, ctx, adapter) -> None:
        raise NotImplementedError

    def free_adapter(self, adapter) -> None:
        raise NotImplementedError

    def free_model(self, model) -> None:
        raise NotImplementedError


class SourceApi(_Api):
    """llama-cpp-python's ctypes binding of the llama.cpp it compiled (its own API version, 0.3.36)."""

    name = "source"

    def __init__(self):
        import llama_cpp  # ImportError: not installed

        self.lib = llama_cpp
        if self.name not in self._callbacks:
            self._callbacks[self.name] = llama_cpp.llama_log_callback(_quiet_log)
            llama_cpp.llama_log_set(self._callbacks[self.name], ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        self.label = f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} (built from source)"

    def _context_params(self, params) -> None:
        params.kv_unified = True  # a prompt's cells are shared by its group, not copied
        params.no_perf = True

    def _logits(self, ctx):
        return self.lib.llama_get_logits(ctx)

    def clear(self, ctx) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)

    def seq_cp(self, ctx, src: int, dst: int) -> None:
        self.lib.llama_memory_seq_cp(self.lib.llama_get_memory(ctx), src, dst, -1, -1)

    def load_adapter(self, model, path: Path):
        return self.lib.llama_adapter_lora_init(model, str(path).encode()) or None

    def apply_adapter(self, ctx, adapter) -> None:
        adapters = (self.lib.llama_adapter_lora_p_ctypes * 1)(adapter)
        if self.lib.llama_set_adapters_lora(ctx, adapters, 1, (ctypes.c_float * 1)(1.0)) != 0:
            raise RuntimeError("llama.cpp could not apply the LoRA adapter")

    def free_adapter(self, adapter) -> None:
        self.lib.llama_adapter_lora_free(adapter)

    def free_model(self, model) -> None:
        self.lib.llama_model_free(model)


_P, _I32, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
_IK_EXTRA = {  # name: (argument types, result type): the calls ik-llama-cpp-python leaves unbound
    "llama_get_logits": ([_P], ctypes.POINTER(_F)),
    "llama_kv_cache_seq_cp": ([_P, _I32, _I32, _I32, _I32], None),
    "llama_set_n_threads": ([_P, ctypes.c_uint32, ctypes.c_uint32], None),
    "llama_lora_adapter_init": ([_P, ctypes.c_char_p], _P),
    "llama_lora_adapter_set": ([_P, _P, _F], _I32),
    "llama_lora_adapter_free": ([_P], None),
}
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class WheelApi(_Api):
    """ik-llama-cpp-python: its ctypes module gives the structures (whose layouts are ik_llama.cpp's own);
    the calls it does not bind are declared from ik_llama.cpp's llama.h."""

    name = "wheel"
    auto_weights = "bf16"  # built for AVX2: bf16 sampled as fast as f16 (BENCHMARKS), and a LoRA merges into it
    lora_on_top = False  # an adapter on top of f16 weights gave NaN logits (ik-llama-cpp-python 0.1.5)

    def __init__(self):
        import ik_llama_cpp
        from ik_llama_cpp import _ctypes_api as api  # ImportError: not installed (OSError: library missing)

        self.lib = api
        self.raw = api._lib
        for fn, (args, result) in _IK_EXTRA.items():
            f = getattr(self.raw, fn)
            f.argtypes, f.restype = args, result
        if self.name not in self._callbacks:
            self.raw.llama_log_set.argtypes = [_LOG_CALLBACK, _P]
            self._callbacks[self.name] = _LOG_CALLBACK(_quiet_log)
            self.raw.llama_log_set(self._callbacks[self.name], None)
        api.llama_backend_init()
        self.label = f"ik-llama-cpp-python {getattr(ik_llama_cpp, '__version__', '?')} (wheel)"

    def _context_params(self, params) -> None:
        params.flash_attn = False  # its flash-attention kernel asserts on the engine's batches (ik 0.1.5)

    def _logits(self, ctx):
        return self.raw.llama_get_logits(ctx)

    def set_threads(self, ctx, threads: int) -> None:
        self.raw.llama_set_n_threads(ctx, threads, threads)

    def clear(self, ctx) -> None:
        self.lib.llama_kv_cache_clear(ctx)

    def seq_cp(self, ctx, src: int, dst: int) -> None:
        self.raw.llama_kv_cache_seq_cp(ctx, src, dst, -1, -1)

    def load_adapter(self, model, path: Path):
        return self.raw.llama_lora_adapter_init(model, str(path).encode()) or None

    def apply_adapter(self, ctx, adapter) -> None:
        if self.raw.llama_lora_adapter_set(ctx, adapter, 1.0) != 0:
            raise RuntimeError("llama.cpp could not apply the LoRA adapter")

    def free_adapter(self, adapter) -> None:
        self.raw.llama_lora_adapter_free(adapter)

    def free_model(self, model) -> None:
        self.lib.llama_free_model(model)


def binding(which: str = "auto") -> _Api:
    """The llama.cpp binding `which` (auto: the source build where installed, else the wheel); ImportError
    when it (or, for auto, either) is not installed."""
    if which == "source":
        return SourceApi()
    if which == "wheel":
        return WheelApi()
    if which != "auto":
        raise ValueError(f"llama binding must be one of {', '.join(BINDINGS)}, not {which!r}")
    try:
        return SourceApi()
    except ImportError:
        return WheelApi()
