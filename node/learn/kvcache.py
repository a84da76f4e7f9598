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


def shared_prompt_cache(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, group_size: int):
    """Each prompt but its last token run once, the KV cache repeated over its group: `generate` then
    continues from the last prompt token. Without it every prompt is prefilled `group_size` times, which
    on short-answer mixes is most of a round's generation. None when the model's cache cannot be shared."""
    if group_size < 2 or ids.shape[1] < 2:
        return None
    positions = (attn.cumsum(dim=1) - 1).masked_fill(attn == 0, 1)  # what generate uses for left padding
    try:
        cache = model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], position_ids=positions[:, :-1],
                      use_cache=True, logits_to_keep=1).past_key_values
    except (TypeError, ValueError) as exc:  # a model whose forward takes no cache this way
        log.debug("prompt prefill not shared: %s", exc)
        return None
    if not is_full_attention_cache(cache):
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
        try:
            cache = model(input_ids=torch.tensor([prompts[0][:n]], device=device), use_cache=True,
                          logits_to_keep=1).past_key_values
        except (TypeError, ValueError, NotImplementedError) as exc:
            log.debug("common prompt prefix not shared: %s", exc)
            return None
        if not is_full_attention_cache(cache):
            return None
        return cls(prompts[0][:n], [(layer.keys, layer.values) for layer in cache.layers])

    def batch(self, prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
        """(input ids, attention mask, a fresh cache of the prefix for every row) for `generate`."""
        n, B = len(self.ids), len(prompts)
        width = n + max(len(p) - n for p in prompts)
        ids = torch.full((B, width), pad_id, dtype=torch.long)
        attn = torch.zeros((B, width), dtype=torch.long)
        ids[:, :n] = torch.tensor(self.ids)
        attn[:, :n] = 1
        for i, p in enumerate(prompts):
            rest = p[n:]
            ids[i, width - len(rest):] = torch.tensor(rest)
            attn[i, width - len(rest):] = 1
        device = self.layers[0][0].device
        cache = DynamicCache([(k.expand(B, -1, -1, -1).contiguous(), v.expand(B, -1, -1, -1).contiguous())
                              for k, v in self.layers])
        return ids.to(device), attn.to(device), cache
