"""llama.cpp as the rollout engine on a CPU, through either binding of llama_api.py: the ik_llama.cpp wheel
(installs in seconds) or llama-cpp-python built from source (compiled for this CPU).

Sampling: every prompt is prefilled once into one sequence of a unified KV cache and copied to its other
G - 1 sequences (cells are shared, not duplicated), then all G x I sequences decode together, one
token each per `llama_decode` call, finished ones dropping out. The next token is drawn here from the
returned logits (numpy, seeded from torch's RNG) so temperature, top-p, the behaviour log-prob and the
entropy are exactly the torch sampler's definitions, on llama.cpp's numerics.

Synchronisation: each `sync` writes all weights in `--engine-weights` format (`auto`: bf16 with the wheel;
with a source build bf16 on a CPU with native bf16, where it sampled 1.3x faster than f16
(docs/benchmarks/rollout-engine.md), else f16) and reloads the model; a LoRA model's adapter is merged into them (bf16
with stochastic rounding, or f32: see gguf_export.py). With LoRA and f16 or q8_0 weights (source build
only) the frozen base is written once instead and each sync swaps in only the adapter (a few MB), at the
price of slower sampling: the adapter on top doubles the graph of every decode step.

Its log-probs are llama.cpp's (quantised matmuls, f16 KV cache), so its samples are marked inexact and
the trainer forms pi_old with the training model (node/learn/trainer.py).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from node.learn.engines import gguf_export, llama_api
from node.learn.formats import stop_token_ids
from node.learn.model_io import embedded_model_path
from node.learn.sampling import SampledGroup, SamplingConfig
from node.learn.stop import StopRequest

log = logging.getLogger(__name__)
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)  # it announces every file it writes at INFO
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: larger calls are split by prompt
GREEDY_BATCH = 16  # prompts per greedy call (the held-out evaluation): see `greedy`


class LlamaEngine:
    name = "llama"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str = "",
        weight_type: str = "auto",
        binding: str = "auto",
    ):
        self.api = llama_api.binding(binding)  # ImportError: make_engine falls back to torch
        gguf_export.check_supported(model)
        self._blank(tokenizer, _scratch_dir(model))
        self.weight_type = gguf_export.resolve_weight_type(
            self.api.auto_weights if weight_type == "auto" and self.api.auto_weights else weight_type
        )
        self.source = _source_gguf(model_name)  # the file the model was loaded from, if a GGUF
        self.template = template_for(model_name, tokenizer)
        self.fields = gguf_export.template_fields(self.template)

    def _blank(self, tokenizer: PreTrainedTokenizerBase, scratch: str | None) -> None:
        self.tokenizer = tokenizer
        self.dir = tempfile.TemporaryDirectory(prefix="sapo-llama-", dir=scratch)
        self._frozen: dict = {}  # encodings of the LoRA base's tensors no adapter touches (gguf_export)
        self._model = self._ctx = self._adapter = None
        self._n_ctx = self._n_seq = 0
        self._base_loaded = False
        self._version = 0

    @classmethod
    def from_file(cls, path: Path, tokenizer: PreTrainedTokenizerBase, binding: str = "auto") -> LlamaEngine:
        """An engine on a model file as it is (an export: sapo-ask), never synced: `greedy` and `sample` only."""
        self = cls.__new__(cls)
        self.api = llama_api.binding(binding)
        self.weight_type = "file"
        self.source = self.template = Path(path)
        self.fields = []
        self._blank(tokenizer, None)
        self._load_model(Path(path))
        return self

    # --- synchronisation -----------------------------------------------------------------------------

    def sync(self, model: torch.nn.Module) -> None:
        lora = hasattr(model, "peft_config")
        if lora and self.weight_type not in gguf_export.MERGEABLE:
            if not self.api.lora_on_top:
                raise RuntimeError(
                    f"the {self.api.label} binding cannot apply a LoRA adapter on top of "
                    f"{self.weight_type} weights: --engine-weights auto or bf16 merges it instead"
                )
            if not self._base_loaded:  # written once; each sync then swaps a few-MB adapter
                base = self._write(
                    lambda d: gguf_export.write_model(d / "base.gguf", model, self.fields, self.weight_type)
                )
                self._load_model(base)
                self._base_loaded = True
            self._version += 1
            path = self._write(lambda d: gguf_export.write_lora(d / f"adapter-{self._version}.gguf", model))
            self._load_adapter(path)
        else:  # full weights, or LoRA merged into them (an adapter on top samples at half the speed)
            self._version += 1
            path = self._write(
                lambda d: gguf_export.write_model(
                    d / f"model-{self._version}.gguf",
                    model,
                    self.fields,
                    self.weight_type,
                    merge_lora=lora,
                    frozen=self._frozen if lora else None,
                )
            )
            self._load_model(path)

    def _write(self, write):
        """Write a model file into the scratch directory. Shared memory can fill up after the engine started
        (other processes use it too): then the scratch directory moves, once, to the default temporary
        directory and the write is repeated there, instead of failing the round."""
        try:
            return write(Path(self.dir.name))
        except OSError as e:
            if e.errno != errno.ENOSPC or not self.dir.name.startswith("/dev/shm/"):
                raise
        old, self.dir = self.dir, tempfile.TemporaryDirectory(prefix="sapo-llama-")
        log.warning("/dev/shm is full: the llama engine writes its model files to %s from now on", self.dir.name)
        old.cleanup()
        return write(Path(self.dir.name))

    def _load_model(self, path: Path) -> None:
        self._free()
        self._model = self.api.load_model(path)
        self.n_vocab = self.api.n_vocab(self._model)
        if path.parent == Path(self.dir.name):
            path.unlink()  # mapped while loaded; the disk copy is dead weight

    def _load_adapter(self, path: Path) -> None:
        adapter = self.api.load_adapter(self._model, path)
        path.unlink()
        if adapter is None:
            raise RuntimeError("llama.cpp could not load the LoRA adapter")
        if self._ctx is not None:
            self.api.apply_adapter(self._ctx, adapter)
        if self._adapter is not None:
            self.api.free_adapter(self._adapter)
        self._adapter = adapter

    def _context(self, n_ctx: int, n_seq: int):
        """A context with room for `n_ctx` cells and `n_seq` sequences (made again only when too small)."""
        if self._ctx is not None and n_ctx <= self._n_ctx and n_seq <= self._n_seq:
            return self._ctx
        if self._ctx is not None:
            self.api.free_context(self._ctx)
            self._ctx = None
        n_ctx = -(-n_ctx // 256) * 256  # one unified KV cache: a prompt's cells are shared by its group
        ctx = self.api.new_context(self._model, n_ctx, n_seq, max(1, torch.get_num_threads()))
        self._ctx, self._n_ctx, self._n_seq = ctx, n_ctx, n_seq
        if self._adapter is not None:
            self.api.apply_adapter(ctx, self._adapter)
        return ctx

    def _free(self) -> None:
        if self._ctx is not None:
            self.api.free_context(self._ctx)
        if self._adapter is not None:
            self.api.free_adapter(self._adapter)
        if self._model is not None:
            self.api.free_model(self._model)
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

    def sample(
        self, prompts: list[str], group_size: int, cfg: SamplingConfig, stop: StopRequest | None = None
    ) -> list[SampledGroup]:
        per_call = max(1, MAX_SEQUENCES // max(group_size, 1))
        out: list[SampledGroup] = []
        for start in range(0, len(prompts), per_call):
            seed = int(torch.randint(0, 2**63 - 1, (1,)))  # torch's RNG: checkpointed, so resume replays it
            out += self._sample(prompts[start : start + per_call], group_size, cfg, stop, seed)
        return out

    def _sample(
        self, prompts: list[str], G: int, cfg: SamplingConfig, stop: StopRequest | None, seed: int
    ) -> list[SampledGroup]:
        rng = np.random.default_rng(seed)
        prompt_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completions, logps, entropies = self._generate(
            prompt_ids, G, cfg.max_new_tokens, lambda logits: _draw(logits, cfg, rng), stop
        )
        groups = []
        for p, ids in enumerate(prompt_ids):
            sl = slice(p * G, p * G + G)
            groups.append(
                SampledGroup(
                    prompt_ids=list(ids),
                    completion_ids=completions[sl],
                    behaviour_logp=logps[sl],
                    texts=[self.tokenizer.decode(c, skip_special_tokens=True) for c in completions[sl]],
                    entropy=[float(np.mean(e)) if e else 0.0 for e in entropies[sl]],
                    logp_exact=False,
                )
            )
        return groups

    def greedy(
        self, prompts: list[str], max_new_tokens: int, batch_size: int = GREEDY_BATCH, stop: StopRequest | None = None
    ) -> list[str]:
        """Greedy completions (the argmax token each step, as `evaluate.greedy_texts` takes it from torch's
        logits), decoded without special tokens, in the order of `prompts`: the held-out evaluation through
        the engine (node/learn/evaluate.py). `batch_size` prompts per call, of similar length (sorted): the
        unified KV cache holds all of a call's rows and each attends over all its cells (masked), so beyond a
        few dozen prompts a larger call costs more per prompt, not less."""
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(ids[i]))
        texts: list[str] = [""] * len(prompts)
        step = max(1, min(batch_size, MAX_SEQUENCES))
        for start in range(0, len(order), step):
            batch = order[start : start + step]
            completions, _, _ = self._generate([ids[i] for i in batch], 1, max_new_tokens, _argmax, stop)
            for i, c in zip(batch, completions):
                texts[i] = self.tokenizer.decode(c, skip_special_tokens=True)
        return texts

    def _generate(self, prompt_ids: list[list[int]], G: int, max_new_tokens: int, pick, stop: StopRequest | None):
        """`G` completions of each prompt, rows in group order (prompt p's at p * G ... p * G + G - 1), each
        ending at its first stop token (`stop_token_ids`, the torch sampler's) or after `max_new_tokens`;
        `pick(logits)` gives each row's (token, log-prob, entropy). Returns (completions, log-probs,
        entropies) per row."""
        api = self.api
        if stop is not None:
            stop.check()
        rows = len(prompt_ids) * G
        ctx = self._context(sum(map(len, prompt_ids)) + rows * max_new_tokens + 1, rows)
        api.set_threads(ctx, max(1, torch.get_num_threads()))
        api.clear(ctx)
        batch = api.batch_init(max(sum(map(len, prompt_ids)), rows))
        completions: list[list[int]] = [[] for _ in range(rows)]
        logps: list[list[float]] = [[] for _ in range(rows)]
        entropies: list[list[float]] = [[] for _ in range(rows)]
        try:
            # prefill: the prompts' common prefix (the chat template and system prompt) once, as sequence 0,
            # shared with every prompt's sequence p * G; then the rest of prompt p there, whose last logits
            # start all G completions
            shared = _common_prefix(prompt_ids)
            if shared:
                self._decode(ctx, batch, [(tok, pos, 0, False) for pos, tok in enumerate(prompt_ids[0][:shared])])
                for p in range(1, len(prompt_ids)):
                    api.seq_cp(ctx, 0, p * G)
            entries = [
                (ids[pos], pos, p * G, pos == len(ids) - 1)
                for p, ids in enumerate(prompt_ids)
                for pos in range(shared, len(ids))
            ]
            logits = self._decode(ctx, batch, entries)
            for p in range(len(prompt_ids)):
                for g in range(1, G):
                    api.seq_cp(ctx, p * G, p * G + g)
            logits = np.repeat(logits, G, axis=0) if G > 1 else logits
            active = list(range(rows))
            stops = set(stop_token_ids(self.tokenizer))
            for step in range(max_new_tokens):
                tokens, lp, ent = pick(logits)
                still = []
                for i, row in enumerate(active):
                    completions[row].append(int(tokens[i]))
                    logps[row].append(float(lp[i]))
                    entropies[row].append(float(ent[i]))
                    if int(tokens[i]) not in stops:
                        still.append(row)
                active = still
                if not active or step == max_new_tokens - 1:
                    break
                if stop is not None:
                    stop.check()
                pos = {row: len(prompt_ids[row // G]) + len(completions[row]) - 1 for row in active}
                logits = self._decode(ctx, batch, [(completions[r][-1], pos[r], r, True) for r in active])
        finally:
            api.batch_free(batch)
        return completions, logps, entropies

    def _decode(self, ctx, batch, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        return self.api.decode(ctx, batch, entries, self.n_vocab)


BLOCK = 1024  # vocabulary entries per block of the two-level inverse-CDF draw


def _common_prefix(prompt_ids: list[list[int]]) -> int:
    """Tokens every prompt begins with, leaving each at least its last token (whose logits it needs)."""
    shortest = min(len(ids) for ids in prompt_ids) - 1
    first = prompt_ids[0]
    for n in range(max(shortest, 0)):
        if any(ids[n] != first[n] for ids in prompt_ids):
            return n
    return max(shortest, 0)


def _argmax(logits: np.ndarray):
    """Greedy: each row's most likely token (the first of a tie, as torch's argmax), no log-prob or entropy."""
    zeros = np.zeros(len(logits))
    return logits.argmax(axis=1), zeros, zeros


def _draw(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator):
    """One token per row from softmax(logits / T) (top-p truncated when < 1): (tokens, log-probs under the
    untruncated scaled distribution, entropies), as the torch sampler records them.

    Runs once per decode step over [rows, vocab] (32 x 49152 at the default settings), so it is kept to
    four passes in float32 with float64 sums: the inverse CDF is found block by block (block sums, then a
    cumulative sum inside the one block that holds u), not by a cumulative sum over the whole vocabulary.
    Three times faster than the float64 one-pass form and the same tokens for the same uniforms."""
    x = logits / np.float32(cfg.temperature) if cfg.temperature != 1.0 else logits
    n, vocab = x.shape
    top = x.max(axis=1, keepdims=True)
    probs = np.subtract(x, top, dtype=np.float32)
    np.exp(probs, out=probs)  # unnormalised: exp(x - max)
    starts = np.arange(0, vocab, BLOCK)
    blocks = np.add.reduceat(probs, starts, axis=1, dtype=np.float64)
    total = blocks.sum(axis=1)
    lse = np.log(total) + top[:, 0]
    entropy = lse - np.einsum("ij,ij->i", probs, x, dtype=np.float64) / total
    if cfg.top_p < 1.0:
        order = np.argsort(-probs, axis=1)
        sorted_p = np.take_along_axis(probs, order, axis=1)
        keep = np.cumsum(sorted_p, axis=1, dtype=np.float64) - sorted_p < cfg.top_p * total[:, None]
        probs = np.zeros_like(probs)  # smallest set reaching top_p
        np.put_along_axis(probs, order, sorted_p * keep, axis=1)
        blocks = np.add.reduceat(probs, starts, axis=1, dtype=np.float64)
    cum_blocks = np.cumsum(blocks, axis=1)
    u = rng.random(n) * cum_blocks[:, -1]
    tokens = np.empty(n, dtype=np.int64)
    for i in range(n):
        b = min(int(np.searchsorted(cum_blocks[i], u[i], side="left")), len(starts) - 1)
        inner = np.cumsum(probs[i, starts[b] : starts[b] + BLOCK], dtype=np.float64)
        rest = u[i] - (cum_blocks[i, b] - blocks[i, b])
        tokens[i] = min(starts[b] + int(np.searchsorted(inner, rest, side="left")), vocab - 1)
    logp = x[np.arange(n), tokens].astype(np.float64) - lse
    return tokens, logp, entropy


def _scratch_dir(model: torch.nn.Module) -> str | None:
    """Where the model file of each sync is written: shared memory when it has room for four float32 copies
    (a file on disk is written back to the disk every round: seconds of I/O for 270 MB), else the default
    temporary directory (Docker's default /dev/shm is 64 MB)."""
    need = 4 * 4 * sum(p.numel() for p in model.parameters())
    try:
        if os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free > need:
            return "/dev/shm"
    except OSError:
        pass
    return None


def _source_gguf(model_name: str) -> Path | None:
    if model_name == "default":
        return embedded_model_path()
    return Path(model_name) if model_name.endswith(".gguf") else None


def template_for(model_name: str, tokenizer: PreTrainedTokenizerBase) -> Path:
    """A GGUF file whose tokenizer matches: the model's own source file, or the embedded SmolLM2 file for
    models with its vocabulary (tiny-random-smol)."""
    source = _source_gguf(model_name)
    if source is not None and source.exists():
        return source
    embedded = embedded_model_path()
    ref = embedded_model_tokens()
    if len(tokenizer) == len(ref) and tokenizer.convert_ids_to_tokens(list(range(0, len(ref), 997))) == [
        ref[i] for i in range(0, len(ref), 997)
    ]:
        return embedded
    raise ValueError("the llama engine needs a GGUF source or SmolLM2's vocabulary for the tokenizer metadata")


def embedded_model_tokens() -> list[str]:
    """The embedded model's vocabulary. Parsing a GGUF's metadata costs seconds of CPU (its 49k tokens and
    merges), and every node on another model pays it once to learn the engine cannot serve it, so the list
    is kept beside the cached models, keyed by the file's path, size and time (a new file, a new list)."""
    import gguf

    from node.learn.packaged import cached_json, derived_name

    path = embedded_model_path()
    return cached_json(
        derived_name("gguf-tokens", path),
        lambda: gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents(),
        lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
    )
