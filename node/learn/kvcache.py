"""KV-cache reuse: a prompt, or a prefix all prompts share, runs once and its cache serves many rows.

Sampling prefills each prompt once for its G completions (`shared_prompt_cache`), the held-out
evaluation runs the chat template and system prompt once for the whole set (`CommonPrefix`), and
training scores a group's completions on its prompt's cache (node/learn/prefix.py). All of it needs a
cache whose rows can be selected, repeated and extended: `is_full_attention_cache`.
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

log = logging.getLogger(__name__)


def is_full_attention_cache(cache) -> bool:
    """A plain DynamicCache of full-attention layers: rows can be selected, repeated and extended freely
    (sliding windows, recurrent state or encoder-decoder caches cannot)."""
    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


def left_padded(rows: list[list[int]] | list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-aligned in one [B, longest] batch: (ids, attention mask), on the CPU."""
    width = max(map(len, rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row)
            attn[i, width - len(row):] = 1
    return ids, attn


def generate_positions(attn: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch as `generate` counts them (over real tokens; pads get 1), so a
    decoding or a cache made outside `generate` gives its tokens."""
    return (attn.cumsum(dim=1) - 1).masked_fill(attn == 0, 1)


def _reusable_cache(model: torch.nn.Module, what: str, **inputs):
    """The KV cache of one forward over `inputs`, or None when the model takes no cache this way or
    returns one whose rows cannot be repeated and extended."""
    try:
        cache = model(**inputs, use_cache=True, logits_to_keep=1).past_key_values
    except (TypeError, ValueError, NotImplementedError) as exc:
        log.debug("%s not shared: %s", what, exc)
        return None
    return cache if is_full_attention_cache(cache) else None


def shared_prompt_cache(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, group_size: int):
    """Each prompt but its last token run once, the KV cache repeated over its group: `generate` then
    continues from the last prompt token. Without it every prompt is prefilled `group_size` times, which
    on short-answer mixes is most of a round's generation. None when the model's cache cannot be shared."""
    if group_size < 2 or ids.shape[1] < 2:
        return None
    positions = generate_positions(attn)
    cache = _reusable_cache(model, "prompt prefill", input_ids=ids[:, :-1], attention_mask=attn[:, :-1],
                            position_ids=positions[:, :-1])
    if cache is None:
        return None
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(group_size, dim=0)
        layer.values = layer.values.repeat_interleave(group_size, dim=0)
    return cache


class CommonPrefix:
    """A token prefix every prompt of a set starts with (chat template, system prompt), run once; each
    batch continues from a copy of its KV cache. Rows are laid out [prefix | left pad | rest of prompt]:
    the attention mask skips the pad in the middle, and position ids, counted over real tokens, continue
    from the prefix exactly as in the unshared layout."""

    MIN_TOKENS = 8  # below this the saving does not pay for the extra call

    def __init__(self, ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.ids, self.layers = ids, layers

    @classmethod
    @torch.no_grad()
    def build(cls, model: torch.nn.Module, prompts: list[list[int]]) -> CommonPrefix | None:
        """None when the prompts share too little, or the model's cache cannot be reused this way."""
        if not prompts:
            return None
        n, shortest = 0, min(map(len, prompts))
        while n < shortest - 1 and all(p[n] == prompts[0][n] for p in prompts):  # leave every prompt a token
            n += 1
        if n < cls.MIN_TOKENS:
            return None
        device = next(model.parameters()).device
        cache = _reusable_cache(model, "common prompt prefix", input_ids=torch.tensor([prompts[0][:n]], device=device))
        if cache is None:
            return None
        return cls(prompts[0][:n], [(layer.keys, layer.values) for layer in cache.layers])

    def batch(self, prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
        """(input ids, attention mask, a fresh cache of the prefix for every row) for `generate`."""
        n, B = len(self.ids), len(prompts)
        rest_ids, rest_attn = left_padded([p[n:] for p in prompts], pad_id)
        ids = torch.cat([torch.tensor([self.ids]).expand(B, n), rest_ids], dim=1)
        attn = torch.cat([torch.ones((B, n), dtype=torch.long), rest_attn], dim=1)
        device = self.layers[0][0].device
        cache = DynamicCache([(k.expand(B, -1, -1, -1).contiguous(), v.expand(B, -1, -1, -1).contiguous())
                              for k, v in self.layers])
        return ids.to(device), attn.to(device), cache
