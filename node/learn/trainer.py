"""One GRPO update per round: several optimizer steps over the round's sequences with a fixed pi_old.

With a `StopRequest`, the update can be abandoned (RoundAbandoned) between micro-batches, but only
before its first optimizer step: weights and optimizer are then exactly those of the last completed
round. Once a step is taken, the (short) rest of the update runs to its end.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import math
import random
import sys
from dataclasses import dataclass

import torch

from node.learn.grpo import external_weight, grpo_loss
from node.learn.lora import Adapter
from node.learn.precision import update_attention
from node.learn.prefix import PREFIX_SHARING, micro_batches, supports_prefix_sharing
from node.learn.sampling import Sequence
from node.learn.screen import ExternalScreen, ScreenReport
from node.learn.stop import RoundAbandoned, StopRequest


@dataclass
class TrainConfig:
    lr: float = 1e-6  # the node default (docs/experiments/learning-rate-cpu-easy.md)
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0  # KL weight; > 0 keeps a frozen copy of the initial model as reference
    loss_type: str = "grpo"
    scale_std: bool = True
    max_grad_norm: float = 1.0
    epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch
    micro_batch_size: int = 16  # sequences per forward/backward (memory bound), gradients accumulate
    temperature: float = 1.0  # same scaling as at sampling time
    max_completion_len: int = 256  # dr_grpo's constant normaliser
    prefix_sharing: str = "auto"  # auto: share each group's prompt when the model's cache allows it

    def validate(self) -> None:
        if self.epochs < 1 or self.minibatches < 1 or self.micro_batch_size < 1:
            raise ValueError("epochs, minibatches and micro batch size must be >= 1")
        if self.prefix_sharing not in PREFIX_SHARING:
            raise ValueError(f"prefix sharing must be one of {PREFIX_SHARING}")


@dataclass
class StepStats:
    loss: float = 0.0
    clip_frac: float = 0.0
    ratio_mean: float = 1.0
    kl: float = 0.0
    grad_norm: float = 0.0
    optimizer_steps: int = 0
    sequences: int = 0
    tokens: int = 0
    external_weight: float | None = None  # mean importance weight of the weighted external completions, if any
    screen: ScreenReport | None = None  # what the external screen dropped and masked (None: no screen)


class Trainer:
    """With `adapter` (LoRA), only the adapter's weights are optimised and the KL reference is the base
    model with the adapters disabled; otherwise every weight, and the reference a frozen copy. Peers that
    share one base activate their adapter before handing the trainer a step (`Adapter.activate`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        cfg: TrainConfig,
        seed: int = 0,
        stop: StopRequest | None = None,
        adapter: Adapter | None = None,
        screen: ExternalScreen | None = None,
    ):
        cfg.validate()
        self.screen = screen  # --external-screen: shapes other peers' right answers (node/learn/screen.py)
        self.stop = stop
        self.steps_taken = 0  # optimizer steps since this trainer was made (counted as each one starts)
        self._update_began_at = 0  # steps_taken when the current update began
        self.model = model
        self.adapter = adapter
        self.pad_id = pad_id
        self.cfg = cfg
        self.params = adapter.parameters() if adapter is not None else list(model.parameters())
        # foreach=False: the multi-tensor path allocates a copy of all parameters per update (peak memory)
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr, foreach=False)
        full_copy = cfg.beta > 0 and adapter is None
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if full_copy else None
        self.rng = random.Random(seed)
        self._shared: bool | None = None  # decided on first use (auto probes the model once)
        self._weights_seen: list[float] = []  # this update's importance weights of external completions

    @property
    def _stepped(self) -> bool:
        """An optimizer step was taken in the current update: no abandoning now."""
        return self.steps_taken != self._update_began_at

    @property
    def shared_prefix(self) -> bool:
        """Whether each group's prompt runs once (see node/learn/prefix.py) or once per completion."""
        if self._shared is None:
            mode = self.cfg.prefix_sharing
            works = mode != "off" and supports_prefix_sharing(self.model, self.pad_id)
            if mode == "on" and not works:
                raise ValueError("--prefix-sharing on: this model's KV cache cannot be shared across a group")
            self._shared = works
        return self._shared

    def _micro_batches(self, model: torch.nn.Module, seqs: list[Sequence]):
        return micro_batches(
            model, seqs, self.pad_id, self.cfg.temperature, self.cfg.micro_batch_size, self.shared_prefix
        )

    @property
    def single_step(self) -> bool:
        """One optimizer step per update (the default): its forward pass runs on the weights pi_old means."""
        return self.cfg.epochs * self.cfg.minibatches == 1

    @torch.no_grad()
    def fill_old_logp(self, seqs: list[Sequence]) -> None:
        """pi_old for sequences without exact behaviour log-probs (external groups, samples of a rollout
        engine whose numerics differ): one no-grad pass now, in the same layout (shared or plain) as the
        training forward. With a single optimizer step this pass is skipped: the step's own forward, taken
        before any weight moves, is that same pi_old (`_old_logp`)."""
        todo = [s for s in seqs if s.old_logp is None]
        for chunk, logp, mask in self._micro_batches(self.model, todo):
            self._safe_point()
            for s, row, m in zip(chunk, logp, mask):
                s.old_logp = row[: int(m.sum())].tolist()

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        """A new learning rate from the next optimizer step on (the collapse guard lowers it)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, seqs: list[Sequence]) -> StepStats:
        """epochs x minibatches optimizer steps; pi_old stays the one recorded before the first step."""
        stats = StepStats(sequences=len(seqs))
        if not seqs:
            stats.screen = self.screen.take() if self.screen is not None else None
            return stats
        self._update_began_at = self.steps_taken
        watch = self.stop.watch(self.model, lambda: not self._stepped) if self.stop else contextlib.nullcontext()
        try:
            with watch, update_attention(self.model, self.ref_model):
                return self._update(seqs, stats)
        except RoundAbandoned:
            self.optimizer.zero_grad(set_to_none=True)  # drop half-accumulated gradients
            raise
        finally:
            stats.screen = self.screen.take() if self.screen is not None else None

    def _update(self, seqs: list[Sequence], stats: StepStats) -> StepStats:
        self._weights_seen = []
        if not self.single_step:
            self.fill_old_logp(seqs)
        refs = self._ref_logprobs(seqs)  # once per update: the reference model never changes
        seqs = self._screened(seqs, refs)
        stats.sequences = len(seqs)
        if not seqs:
            return stats
        order = list(range(len(seqs)))
        totals = {"loss": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "kl": 0.0, "grad_norm": 0.0}
        for _ in range(self.cfg.epochs):
            self.rng.shuffle(order)
            per_mb = math.ceil(len(order) / self.cfg.minibatches)
            for start in range(0, len(order), per_mb):
                minibatch = [seqs[i] for i in order[start : start + per_mb]]
                mb = self._optimizer_step(minibatch, refs)
                for key in totals:
                    totals[key] += mb[key]
                stats.optimizer_steps += 1
                stats.tokens += int(mb["tokens"])
        for key, value in totals.items():
            setattr(stats, key, value / max(stats.optimizer_steps, 1))
        if self._weights_seen:
            stats.external_weight = sum(self._weights_seen) / len(self._weights_seen)
        self.optimizer.zero_grad(set_to_none=True)  # gradients are dead weight until the next round
        release_freed_memory()
        return stats

    def _optimizer_step(self, minibatch: list[Sequence], refs: dict[int, list[float]] | None) -> dict[str, float]:
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = round(sum(_kept_tokens(s) for s in minibatch))
        acc = {"loss": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "kl": 0.0, "tokens": 0.0}
        with sparse_embedding_grads(self.model):
            acc = self._accumulate(minibatch, refs, acc, total_tokens)
        self._safe_point()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        self.steps_taken += 1
        self.optimizer.step()
        acc["grad_norm"] = float(grad_norm)
        return acc

    def _accumulate(
        self, minibatch: list[Sequence], refs: dict[int, list[float]] | None, acc: dict[str, float], total_tokens: int
    ) -> dict[str, float]:
        """Forward and backward of every micro-batch; gradients add up in the parameters."""
        cfg = self.cfg
        for chunk, logp, mask in self._micro_batches(self.model, minibatch):
            mask = _weighted_mask(chunk, mask)
            old = _old_logp(chunk, logp)
            ref = None if refs is None else _padded([refs[id(s)] for s in chunk], logp)
            adv = torch.tensor([s.advantage for s in chunk], dtype=logp.dtype, device=logp.device)
            seq_weight = self._external_weights(chunk, old, mask)
            self._safe_point()
            loss, st = grpo_loss(
                logp,
                old,
                adv,
                mask,
                cfg.eps_low,
                cfg.eps_high,
                cfg.loss_type,
                cfg.beta,
                ref,
                cfg.max_completion_len,
                seq_weight,
            )
            # Weight each micro-batch so the sum equals the loss over the whole minibatch.
            n_tokens = int(mask.sum())
            weight = n_tokens / max(total_tokens, 1) if cfg.loss_type == "dapo" else len(chunk) / len(minibatch)
            (loss * weight).backward()
            acc["loss"] += st.loss * weight
            tok_w = n_tokens / max(total_tokens, 1)
            acc["clip_frac"] += st.clip_frac * tok_w
            acc["ratio_mean"] += st.ratio_mean * tok_w
            acc["kl"] += st.kl * tok_w
            acc["tokens"] += n_tokens
        return acc

    def _external_weights(self, chunk: list[Sequence], old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """Each sequence's weight in the loss: 1, or for another peer's completion that came with the publisher's
        log-probs, min(1, pi_old / mu) on mean token log-probs (--external-loss is/ftis). None when all are 1."""
        weighted = [i for i, s in enumerate(chunk) if s.behaviour_mean_logp is not None]
        if not weighted:
            return None
        mask = mask.to(old.dtype)
        old_mean = (old.detach() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        mu = torch.tensor([chunk[i].behaviour_mean_logp for i in weighted], dtype=torch.float64)
        weights = torch.ones(len(chunk), dtype=torch.float64)
        weights[weighted] = external_weight(old_mean[weighted].cpu(), mu)
        self._weights_seen.extend(weights[weighted].tolist())
        return weights.to(device=old.device, dtype=old.dtype)

    def _safe_point(self) -> None:
        """Abandon here if a stop was requested and no optimizer step was taken in this update."""
        if self.stop is not None and not self._stepped:
            self.stop.check()

    @property
    def reference(self) -> str:
        """What the reference is: the base with the adapter off, a frozen copy (full fine-tuning, beta > 0), none."""
        return "base" if self.adapter is not None else "copy" if self.ref_model is not None else "none"

    def _screened(self, seqs: list[Sequence], refs: dict[int, list[float]] | None) -> list[Sequence]:
        """The external screen's reference part: other peers' right answers whose kept text the reference finds
        far less likely than our own completions are masked or dropped (node/learn/screen.py). Its log-probs
        are the KL term's where that runs, else one no-grad pass over our and the screened sequences."""
        screen = self.screen
        judged = [s for s in seqs if s.screened]
        if screen is None or not screen.cfg.reference or not judged or self.reference == "none":
            return seqs
        own = [s for s in seqs if s.source is None]
        refs = refs if refs is not None else self._reference_pass(own + judged)
        verdicts = screen.judge_reference(
            [refs[id(s)] for s in own],
            [(str(s.source)[:16], refs[id(s)], s.token_weights or [1.0] * len(s.completion_ids)) for s in judged],
            self.reference,
        )
        dropped = set()
        for s, weights in zip(judged, verdicts):
            if weights is None:
                dropped.add(id(s))
            elif 0.0 in weights:
                s.token_weights = weights
        return [s for s in seqs if id(s) not in dropped]

    @torch.no_grad()
    def _ref_logprobs(self, seqs: list[Sequence]) -> dict[int, list[float]] | None:
        """The reference model's log-probs per sequence (keyed by id), when the KL term is on."""
        if self.cfg.beta <= 0:
            return None
        return self._reference_pass(seqs)

    @torch.no_grad()
    def _reference_pass(self, seqs: list[Sequence]) -> dict[int, list[float]]:
        out = {}
        reference = self.adapter.disabled() if self.adapter is not None else contextlib.nullcontext()
        with reference:
            for chunk, logp, mask in self._micro_batches(self.ref_model or self.model, seqs):
                self._safe_point()  # a reference copy has no stop hooks of its own
                for s, row, m in zip(chunk, logp, mask):
                    out[id(s)] = row[: int(m.sum())].tolist()
        return out


@contextlib.contextmanager
def sparse_embedding_grads(model: torch.nn.Module):
    """The input embedding's gradient as the rows that were looked up, not a dense [vocab, d] matrix.

    A dense embedding backward zero-fills and adds a vocab-sized matrix on every backward pass (for a
    135M model with a 49k vocabulary: 113 MB, about a sixth of a shared-prefix micro-batch on CPU). With
    a tied LM head the rows are added into the head's dense gradient; an untied embedding's gradient is
    made dense once per optimizer step, on exit, since Adam and clipping take dense gradients.
    """
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(emb, torch.nn.Embedding) or emb.sparse:
        yield
        return
    emb.sparse = True
    try:
        yield
    finally:
        emb.sparse = False
        if emb.weight.grad is not None and emb.weight.grad.is_sparse:
            emb.weight.grad = emb.weight.grad.to_dense()


def release_freed_memory() -> None:
    """Hand freed activation memory back to the OS (glibc keeps it otherwise): several peers share one
    machine's RAM, and each one's resident size would otherwise creep up to its worst round."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass


def _kept_tokens(s: Sequence) -> float:
    """The completion tokens that count in the loss: all, or those the external screen left a weight."""
    return len(s.completion_ids) if s.token_weights is None else sum(s.token_weights)


def _weighted_mask(chunk: list[Sequence], mask: torch.Tensor) -> torch.Tensor:
    """The completion mask times each token's screen weight; the mask itself where no sequence has weights."""
    if all(s.token_weights is None for s in chunk):
        return mask
    weights = torch.ones_like(mask)
    for i, s in enumerate(chunk):
        if s.token_weights is not None:
            row = s.token_weights[: mask.shape[1]]
            weights[i, : len(row)] = torch.tensor(row, dtype=mask.dtype)
    return mask * weights


def _old_logp(chunk: list[Sequence], logp: torch.Tensor) -> torch.Tensor:
    """pi_old per token: the recorded behaviour log-probs, and for a sequence without them (only reached
    with a single optimizer step, before it) this forward's own log-probs, detached: ratio exactly 1."""
    old = _padded([s.old_logp for s in chunk], logp)
    missing = [i for i, s in enumerate(chunk) if s.old_logp is None]
    if missing:
        old[missing] = logp.detach()[missing]
    return old


def _padded(rows: list[list[float] | None], like: torch.Tensor) -> torch.Tensor:
    """Per-sequence lists as a zero-padded tensor with `like`'s width, dtype and device."""
    out = torch.zeros((len(rows), like.shape[1]), dtype=like.dtype, device=like.device)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row[: like.shape[1]], dtype=like.dtype)
    return out
