"""Shared-prefix scoring: each group's prompt runs once, its G completions run on top of its KV cache.

All G completions of a group share the prompt, and on short-answer mixes the prompt is most of every
sequence (cpu-easy: ~55-60 of ~83 tokens), so the plain layout recomputes it G times. Here:

    1. the unit's distinct prompts run once, left-padded, with gradients  -> per-layer K, V [U, h, P, d]
       and the logits at the last prompt position (they predict completion token 0);
    2. those tensors are cut off the graph as leaves (`detach().requires_grad_()`);
    3. each micro-batch of completions gathers its prompts' rows of the leaves (`index_select`, so the
       backward *adds* the contributions of all G completions into one prompt row), runs with that
       cache, and its loss is backpropagated: parameters and leaves collect gradients;
    4. when the unit's last micro-batch is done, the leaves' gradients are pushed through the prompt's
       graph once (`torch.autograd.backward(prefix tensors, leaf grads)`).

The result is the same loss and the same gradients as the plain layout (tests/learn/test_prefix.py
checks it in float64 for every loss type), with the prompt's forward and backward done once per unit.
Position ids continue from each prompt's real length and the attention mask is [prompt mask | completion
mask], exactly what the plain layout [left pad | prompt | completion | right pad] computes.

A model whose cache is not a `DynamicCache` of full-attention layers (recurrent state, encoder-decoder)
cannot share this way; `supports_prefix_sharing` probes for it and the trainer then keeps the plain path.
Sliding-window layers (Gemma 3) share while the update's longest sequence fits their window, where they
attend exactly as full attention; an update with a longer one runs plain.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from node.learn.choices import PREFIX_SHARING
from node.learn.kvcache import attention_window, cache_arg, is_full_attention_cache, left_padded, returned_cache
from node.learn.sampling import Sequence, completion_logprobs, token_logprobs

__all__ = [
    "PREFIX_SHARING",
    "Unit",
    "token_budget",
    "plan_units",
    "split_completions",
    "SharedPrefix",
    "micro_batches",
    "supports_prefix_sharing",
]

log = logging.getLogger(__name__)


@dataclass
class Unit:
    """Distinct prompts that run as one prefix batch, and the positions of their sequences."""

    prompts: list[tuple[int, ...]]
    members: list[list[int]]  # per prompt: indices into the caller's sequence list


def token_budget(seqs: list[Sequence], micro_batch_size: int) -> int:
    """Tokens one shared-path micro-batch may hold: what the plain path's worst micro-batch of
    `micro_batch_size` padded sequences holds, so sharing never needs more activation memory per pass
    (and a whole group usually fits in one pass, which is where the speed comes from)."""
    return micro_batch_size * max(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)


def _padded_cost(prompts: list[tuple[int, ...]], completions: list[int]) -> int:
    """Tokens of a prefix batch (left-padded prompts) plus its completions (right-padded)."""
    return len(prompts) * max(map(len, prompts), default=0) + len(completions) * max(completions, default=0)


def plan_units(seqs: list[Sequence], budget: int) -> list[Unit]:
    """Buckets sequences by prompt (first-appearance order) and packs whole buckets into units of at most
    `budget` padded tokens (each prompt once, each completion once); a bucket larger than that is a unit of
    its own (its completions then run in several micro-batches over one prefix)."""
    buckets: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(seqs):
        buckets.setdefault(tuple(s.prompt_ids), []).append(i)
    units: list[Unit] = []
    current = Unit([], [])
    for prompt, members in buckets.items():
        prompts = current.prompts + [prompt]
        lengths = [len(seqs[i].completion_ids) for m in current.members + [members] for i in m]
        if current.prompts and _padded_cost(prompts, lengths) > budget:
            units.append(current)
            current = Unit([], [])
        current.prompts.append(prompt)
        current.members.append(members)
    if current.prompts:
        units.append(current)
    return units


def split_completions(lengths: list[int], budget: int) -> list[int]:
    """Sizes of consecutive micro-batches of completions with these lengths, each at most `budget` padded
    tokens (at least one completion each)."""
    sizes: list[int] = []
    start = 0
    for end in range(1, len(lengths) + 1):
        if end - start > 1 and (end - start) * max(lengths[start:end]) > budget:
            sizes.append(end - 1 - start)
            start = end - 1
    if start < len(lengths):
        sizes.append(len(lengths) - start)
    return sizes


class SharedPrefix:
    """One unit's prompts, run once; completions of any subset of its sequences are scored on top."""

    def __init__(self, model: torch.nn.Module, prompts: list[tuple[int, ...]], pad_id: int, longest: int):
        device = next(model.parameters()).device
        self.model = model
        ids, attn = left_padded(prompts, pad_id)
        self.attn = attn.to(device)
        self.lengths = self.attn.sum(dim=1)
        positions = (self.attn.cumsum(dim=1) - 1).clamp(min=0)
        out = model(
            input_ids=ids.to(device), attention_mask=self.attn, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        cache = returned_cache(out)
        if not is_full_attention_cache(cache, longest):
            raise TypeError(
                f"prefix sharing needs a DynamicCache that attends fully over {longest} tokens, "
                f"got {type(cache).__name__}"
            )
        self.graph = [out.logits[:, -1]] + [t for layer in cache.layers for t in (layer.keys, layer.values)]
        grad = torch.is_grad_enabled()
        self.leaves = [t.detach().requires_grad_(grad) for t in self.graph]

    def logprobs(self, rows: list[int], seqs: list[Sequence], temperature: float):
        """log softmax(logits / T) at each completion token of `seqs`, whose prompts are `rows` of this
        prefix; returns ([B, C] logp, [B, C] mask) as `token_logprobs` does."""
        device = self.attn.device
        index = torch.tensor(rows, device=device)
        C = max(len(s.completion_ids) for s in seqs)
        comp_ids = torch.full((len(seqs), C), 0, dtype=torch.long)
        comp_mask = torch.zeros((len(seqs), C))
        for i, s in enumerate(seqs):
            comp_ids[i, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
            comp_mask[i, : len(s.completion_ids)] = 1.0
        comp_ids, comp_mask = comp_ids.to(device), comp_mask.to(device)
        first = self.leaves[0].index_select(0, index).unsqueeze(1)  # predicts completion token 0
        logp, _ = completion_logprobs(first, comp_ids[:, :1], comp_mask[:, :1], temperature)
        if C > 1:  # the last completion token is only ever a target, never an input
            kv = [t.index_select(0, index) for t in self.leaves[1:]]
            cache = DynamicCache(list(zip(kv[0::2], kv[1::2])))
            attn = torch.cat([self.attn.index_select(0, index), comp_mask[:, : C - 1].long()], dim=1)
            positions = self.lengths.index_select(0, index).unsqueeze(1) + torch.arange(C - 1, device=device)
            rest = self.model(
                input_ids=comp_ids[:, : C - 1],
                attention_mask=attn,
                position_ids=positions,
                **cache_arg(cache),
                use_cache=True,
            ).logits
            # log-probs of the two parts joined, not their [B, C, vocab] logits (a copy the size of the batch)
            rest_logp, _ = completion_logprobs(rest, comp_ids[:, 1:], comp_mask[:, 1:], temperature)
            logp = torch.cat([logp, rest_logp], dim=1)
        return logp, comp_mask.to(logp.dtype)

    def backward(self) -> None:
        """Pushes the gradients the completions left on the leaves through the prompt's graph, once."""
        pairs = [(t, leaf.grad) for t, leaf in zip(self.graph, self.leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.graph, self.leaves = [], []


def micro_batches(
    model: torch.nn.Module, seqs: list[Sequence], pad_id: int, temperature: float, micro_batch_size: int, shared: bool
) -> Iterator[tuple[list[Sequence], torch.Tensor, torch.Tensor]]:
    """(sequences, [B, C] logp, [B, C] mask) per micro-batch: plain, `micro_batch_size` sequences; shared,
    as many groups or completions as fit in the same number of tokens (`token_budget`).

    The consumer may call `.backward()` on a loss of each yielded logp before asking for the next one;
    with `shared`, the prompt's part of those gradients is added when the unit is finished, so the
    generator must be run to its end (a for loop does).
    """
    window = attention_window(model)
    if shared and window is not None and seqs:
        longest = max(len(s.prompt_ids) for s in seqs) + max(len(s.completion_ids) for s in seqs)
        shared = longest <= window  # past the window a sliding layer forgets: the plain layout is exact
    if not shared:
        for start in range(0, len(seqs), micro_batch_size):
            chunk = seqs[start : start + micro_batch_size]
            logp, mask = token_logprobs(model, chunk, pad_id, temperature)
            yield chunk, logp, mask
        return
    if not seqs:
        return
    budget = token_budget(seqs, micro_batch_size)
    for unit in plan_units(seqs, budget):
        longest = max(map(len, unit.prompts)) + max(len(seqs[i].completion_ids) for m in unit.members for i in m)
        prefix = SharedPrefix(model, unit.prompts, pad_id, longest)
        flat = [(row, i) for row, members in enumerate(unit.members) for i in members]
        flat.sort(key=lambda ri: -len(seqs[ri[1]].completion_ids))  # like lengths together: less padding
        room = budget - _padded_cost(unit.prompts, [])  # the prefix's activations live as long as the unit
        start = 0
        for size in split_completions([len(seqs[i].completion_ids) for _, i in flat], room):
            part = flat[start : start + size]
            start += size
            chunk = [seqs[i] for _, i in part]
            logp, mask = prefix.logprobs([row for row, _ in part], chunk, temperature)
            yield chunk, logp, mask
        prefix.backward()


@torch.no_grad()
def supports_prefix_sharing(model: torch.nn.Module, pad_id: int) -> bool:
    """Probe: do the shared and the plain layout give the same log-probs on two short sequences with
    prompts of different lengths? False for any model whose cache cannot be split this way."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    tok = [t % vocab for t in range(3, 12)]
    seqs = [Sequence(tok[:4], tok[4:7], 0.0), Sequence(tok[:2], tok[7:9], 0.0), Sequence(tok[:4], tok[2:5], 0.0)]
    was_training = model.training
    model.eval()  # no dropout in the probe
    try:
        plain, mask = token_logprobs(model, seqs, pad_id, 1.0)
        ((_, shared, _),) = micro_batches(model, seqs, pad_id, 1.0, len(seqs), shared=True)
        order = [0, 2, 1]  # plan_units buckets by prompt
        shared = shared[torch.tensor([order.index(i) for i in range(3)])]
    except Exception as exc:  # any model that cannot take a split cache
        log.info("prefix sharing off: %s", exc)
        return False
    finally:
        model.train(was_training)
    tol = 1e-3 if plain.dtype in (torch.float32, torch.float64) else 5e-2
    diff = float(((plain - shared).abs() * mask).max())
    if not diff <= tol:
        log.info("prefix sharing off: shared and plain log-probs differ by %.3g", diff)
        return False
    return True
