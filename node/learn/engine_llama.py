"""llama.cpp (through llama-cpp-python's low-level API) as the rollout engine on a CPU.

Sampling: every prompt is prefilled once into one sequence of a unified KV cache and copied to its other
G - 1 sequences (cells are shared, not duplicated), then all G x I sequences decode together, one
token each per `llama_decode` call, finished ones dropping out. The next token is drawn here from the
returned logits (numpy, seeded from torch's RNG) so temperature, top-p, the behaviour log-prob and the
entropy are exactly the torch sampler's definitions, on llama.cpp's numerics.

Synchronisation: with LoRA (a PEFT model) the frozen base is written and loaded once and each `sync`
writes only the adapter (a few MB) and swaps it in. With full fine-tuning each `sync` writes all weights
(`--engine-weights`, f16 by default) and reloads the model.

Its log-probs are llama.cpp's (quantised matmuls, f16 KV cache), so its samples are marked inexact and
the trainer forms pi_old with the training model (node/learn/trainer.py).
"""

from __future__ import annotations

import ctypes
import logging
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from node.learn import gguf_export
from node.learn.policy import SampledGroup, SamplingConfig, embedded_model_path
from node.learn.stop import StopRequest

log = logging.getLogger(__name__)
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: larger calls are split by prompt


def _quiet_log(level, text, user_data) -> None:
    """llama.cpp logs every load to stderr; the node's own log says what matters."""


class LlamaEngine:
    name = "llama"

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, model_name: str = "",
                 weight_type: str = "f16"):
        import llama_cpp  # ImportError: make_engine falls back to torch

        gguf_export.check_supported(model)
        self.ll = llama_cpp
        self.tokenizer = tokenizer
        self.weight_type = weight_type
        self.source = _source_gguf(model_name)  # the file the model was loaded from, if a GGUF
        self.template = _template_for(model_name, tokenizer)
        self.fields = gguf_export.template_fields(self.template)
        self.dir = tempfile.TemporaryDirectory(prefix="sapo-llama-")
        self._log_cb = llama_cpp.llama_log_callback(_quiet_log)  # kept alive as long as the engine
        llama_cpp.llama_log_set(self._log_cb, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        self._model = self._ctx = self._adapter = None
        self._n_ctx = self._n_seq = 0
        self._base_loaded = False
        self._version = 0

    # --- synchronisation -----------------------------------------------------------------------------

    def sync(self, model: torch.nn.Module) -> None:
        if hasattr(model, "peft_config"):
            if not self._base_loaded:
                # written once in --engine-weights format: the embedded Q4_1 file itself holds the same base
                # weights, but its kernels with the adapter on top sampled at half the f16 speed (BENCHMARKS)
                base = gguf_export.write_model(Path(self.dir.name) / "base.gguf", model, self.fields, self.weight_type)
                self._load_model(base)
                self._base_loaded = True
            self._version += 1
            path = gguf_export.write_lora(Path(self.dir.name) / f"adapter-{self._version}.gguf", model)
            self._load_adapter(path)
        else:
            self._version += 1
            path = gguf_export.write_model(Path(self.dir.name) / f"model-{self._version}.gguf", model, self.fields,
                                           self.weight_type)
            self._load_model(path)

    def _load_model(self, path: Path) -> None:
        ll = self.ll
        self._free()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        loaded = ll.llama_model_load_from_file(str(path).encode(), params)
        if not loaded:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._model = loaded
        self._vocab = ll.llama_model_get_vocab(loaded)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        if path.parent == Path(self.dir.name):
            path.unlink()  # mapped while loaded; the disk copy is dead weight

    def _load_adapter(self, path: Path) -> None:
        ll = self.ll
        adapter = ll.llama_adapter_lora_init(self._model, str(path).encode())
        path.unlink()
        if not adapter:
            raise RuntimeError("llama.cpp could not load the LoRA adapter")
        if self._ctx is not None:
            self._apply_adapter(adapter)
        if self._adapter is not None:
            ll.llama_adapter_lora_free(self._adapter)
        self._adapter = adapter

    def _apply_adapter(self, adapter) -> None:
        ll = self.ll
        adapters = (ll.llama_adapter_lora_p_ctypes * 1)(adapter)
        scales = (ctypes.c_float * 1)(1.0)
        if ll.llama_set_adapters_lora(self._ctx, adapters, 1, scales) != 0:
            raise RuntimeError("llama.cpp could not apply the LoRA adapter")

    def _context(self, n_ctx: int, n_seq: int):
        """A context with room for `n_ctx` cells and `n_seq` sequences (made again only when too small)."""
        ll = self.ll
        if self._ctx is not None and n_ctx <= self._n_ctx and n_seq <= self._n_seq:
            return self._ctx
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx = -(-n_ctx // 256) * 256
        params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max = n_seq
        params.kv_unified = True  # a prompt's cells are shared by its group, not copied
        params.no_perf = True
        threads = max(1, torch.get_num_threads())
        params.n_threads = params.n_threads_batch = threads
        ctx = ll.llama_init_from_model(self._model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._ctx, self._n_ctx, self._n_seq = ctx, n_ctx, n_seq
        if self._adapter is not None:
            self._apply_adapter(self._adapter)
        return ctx

    def _free(self) -> None:
        ll = self.ll
        if self._ctx is not None:
            ll.llama_free(self._ctx)
        if self._adapter is not None:
            ll.llama_adapter_lora_free(self._adapter)
        if self._model is not None:
            ll.llama_model_free(self._model)
        self._ctx = self._adapter = self._model = None
        self._n_ctx = self._n_seq = 0

    def close(self) -> None:
        self._free()
        self.dir.cleanup()

    def __del__(self) -> None:
        try:
            self._free()
        except Exception:
            pass

    # --- sampling -------------------------------------------------------------------------------------

    def sample(self, prompts: list[str], group_size: int, cfg: SamplingConfig,
               stop: StopRequest | None = None) -> list[SampledGroup]:
        per_call = max(1, MAX_SEQUENCES // max(group_size, 1))
        out: list[SampledGroup] = []
        for start in range(0, len(prompts), per_call):
            seed = int(torch.randint(0, 2**63 - 1, (1,)))  # torch's RNG: checkpointed, so resume replays it
            out += self._sample(prompts[start:start + per_call], group_size, cfg, stop, seed)
        return out

    def _sample(self, prompts: list[str], G: int, cfg: SamplingConfig, stop: StopRequest | None,
                seed: int) -> list[SampledGroup]:
        ll = self.ll
        if stop is not None:
            stop.check()
        rng = np.random.default_rng(seed)
        prompt_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        rows = len(prompts) * G
        ctx = self._context(sum(map(len, prompt_ids)) + rows * cfg.max_new_tokens + 1, rows)
        ll.llama_set_n_threads(ctx, max(1, torch.get_num_threads()), max(1, torch.get_num_threads()))
        mem = ll.llama_get_memory(ctx)
        ll.llama_memory_clear(mem, True)
        batch = ll.llama_batch_init(max(sum(map(len, prompt_ids)), rows), 0, 1)
        try:
            # prefill: prompt p once, as sequence p * G; its last logits start all G completions
            entries = [(tok, pos, p * G, pos == len(ids) - 1) for p, ids in enumerate(prompt_ids)
                       for pos, tok in enumerate(ids)]
            logits = self._decode(ctx, batch, entries)
            for p in range(len(prompts)):
                for g in range(1, G):
                    ll.llama_memory_seq_cp(mem, p * G, p * G + g, -1, -1)
            logits = np.repeat(logits, G, axis=0)
            completions: list[list[int]] = [[] for _ in range(rows)]
            logps: list[list[float]] = [[] for _ in range(rows)]
            entropies: list[list[float]] = [[] for _ in range(rows)]
            active = list(range(rows))
            eos = self.tokenizer.eos_token_id
            for step in range(cfg.max_new_tokens):
                tokens, lp, ent = _draw(logits, cfg, rng)
                still = []
                for i, row in enumerate(active):
                    completions[row].append(int(tokens[i]))
                    logps[row].append(float(lp[i]))
                    entropies[row].append(float(ent[i]))
                    if tokens[i] != eos:
                        still.append(row)
                active = still
                if not active or step == cfg.max_new_tokens - 1:
                    break
                if stop is not None:
                    stop.check()
                pos = {row: len(prompt_ids[row // G]) + len(completions[row]) - 1 for row in active}
                logits = self._decode(ctx, batch, [(completions[r][-1], pos[r], r, True) for r in active])
        finally:
            ll.llama_batch_free(batch)
        groups = []
        for p, ids in enumerate(prompt_ids):
            sl = slice(p * G, p * G + G)
            groups.append(SampledGroup(
                prompt_ids=list(ids), completion_ids=completions[sl], behaviour_logp=logps[sl],
                texts=[self.tokenizer.decode(c, skip_special_tokens=True) for c in completions[sl]],
                entropy=[float(np.mean(e)) if e else 0.0 for e in entropies[sl]], logp_exact=False))
        return groups

    def _decode(self, ctx, batch, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode over (token, position, sequence, wants logits) entries; the logits wanted,
        in entry order, as a [n, vocab] float32 array."""
        ll = self.ll
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want
        batch.n_tokens = len(entries)
        rc = ll.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
        n_out = sum(1 for e in entries if e[3])
        ptr = ll.llama_get_logits(ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).copy()


def _draw(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator):
    """One token per row from softmax(logits / T) (top-p truncated when < 1): (tokens, log-probs under the
    untruncated scaled distribution, entropies), as the torch sampler records them."""
    x = logits.astype(np.float64) / cfg.temperature if cfg.temperature != 1.0 else logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    probs = np.exp(x - top)
    total = probs.sum(axis=1, keepdims=True)
    lse = (np.log(total) + top)[:, 0]
    probs /= total
    entropy = lse - (probs * x).sum(axis=1)
    pick = probs
    if cfg.top_p < 1.0:
        order = np.argsort(-probs, axis=1)
        sorted_p = np.take_along_axis(probs, order, axis=1)
        keep = np.cumsum(sorted_p, axis=1) - sorted_p < cfg.top_p  # smallest set reaching top_p
        pick = np.zeros_like(probs)
        np.put_along_axis(pick, order, sorted_p * keep, axis=1)
        pick /= pick.sum(axis=1, keepdims=True)
    cdf = np.cumsum(pick, axis=1)
    u = rng.random(len(x)) * cdf[:, -1]
    tokens = np.minimum((cdf < u[:, None]).sum(axis=1), x.shape[1] - 1)
    logp = x[np.arange(len(x)), tokens] - lse
    return tokens, logp, entropy


def _source_gguf(model_name: str) -> Path | None:
    if model_name == "default":
        return embedded_model_path()
    return Path(model_name) if model_name.endswith(".gguf") else None


def _template_for(model_name: str, tokenizer: PreTrainedTokenizerBase) -> Path:
    """A GGUF file whose tokenizer matches: the model's own source file, or the embedded SmolLM2 file for
    models with its vocabulary (tiny-random-smol)."""
    source = _source_gguf(model_name)
    if source is not None and source.exists():
        return source
    embedded = embedded_model_path()
    ref = embedded_model_tokens()
    if len(tokenizer) == len(ref) and tokenizer.convert_ids_to_tokens(list(range(0, len(ref), 997))) == \
            [ref[i] for i in range(0, len(ref), 997)]:
        return embedded
    raise ValueError("the llama engine needs a GGUF source or SmolLM2's vocabulary for the tokenizer metadata")


def embedded_model_tokens() -> list[str]:
    import gguf

    reader = gguf.GGUFReader(str(embedded_model_path()))
    return reader.fields["tokenizer.ggml.tokens"].contents()
