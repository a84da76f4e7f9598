"""KV-cache reuse: a prompt, or a prefix all prompts share, runs once and its cache serves many rows.

Sampling prefills each prompt once for its G completions (`shared_prompt_cache`), the held-out
evaluation runs the chat template and system prompt once for the whole set (`CommonPrefix`), and
training scores a group's completions on its prompt's cache (node/learn/prefix.py). All of it needs a
cache whose rows can be selected, repeated and extended: `is_full_attention_cache`. Sliding-window layers
(Gemma 3's, window 512) qualify while every sequence that reads the cache fits in the window: no token
then falls out of it, and the window's mask is the causal one.
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

log = logging.getLogger(__name__)

# transformers 5.x renamed a model's `past_key_values` argument and output to `cache` (the old name warns, and
# goes in 5.40); releases before the rename know only the old one. Every call here passes and reads the name
# the installed release has.
CACHE_ARG = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def cache_arg(cache) -> dict:
    """`cache` as the keyword argument a forward or `generate` of the installed transformers takes."""
    return {CACHE_ARG: cache}


def returned_cache(out):
    """The KV cache a forward returned (`use_cache=True`), under the installed transformers' name."""
    return getattr(out, CACHE_ARG)


def is_full_attention_cache(cache, longest: int) -> bool:
    """A DynamicCache that attends like full attention for sequences of up to `longest` tokens (padding
    included): rows can be selected, repeated, extended and rebuilt as plain layers. Full-attention layers
    always; sliding-window layers when `longest` fits their window (recurrent state or encoder-decoder
    caches never)."""
    return isinstance(cache, DynamicCache) and all(
        type(layer) is DynamicLayer or (type(layer) is DynamicSlidingWindowLayer and longest <= layer.sliding_window)
        for layer in cache.layers
    )


def attention_window(model: torch.nn.Module) -> int | None:
    """The smallest sliding window among the model's attention layers (its config's), None when every layer
    attends to the whole sequence. Lets a caller pick a layout before running anything. A config with a
    window but no per-layer types counts as sliding everywhere: a wrong guess only costs the sharing."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    sliding = types is None or any("sliding" in t for t in types)
    return int(window) if window and sliding else None


def left_padded(rows: list[list[int]] | list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-aligned in one [B, longest] batch: (ids, attention mask), on the CPU."""
    width = max(map(len, rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row)
            attn[i, width - len(row) :] = 1
    return ids, attn


def generate_positions(attn: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch as `generate` counts them (over real tokens; pads get 1), so a
    decoding or a cache made outside `generate` gives its tokens."""
    return (attn.cumsum(dim=1) - 1).masked_fill(attn == 0, 1)


def _reusable_cache(model: torch.nn.Module, what: str, longest: int, **inputs):
    """The KV cache of one forward over `inputs`, or None when the model takes no cache this way or
    returns one whose rows cannot be repeated and extended to `longest` tokens."""
    window = attention_window(model)
    if window is not None and longest > window:  # known before running anything: nothing to share
        log.debug("%s not shared: %d tokens exceed the model's attention window (%d)", what, longest, window)
        return None
    try:
        cache = returned_cache(model(**inputs, use_cache=True, logits_to_keep=1))
    except (TypeError, ValueError, NotImplementedError) as exc:
        log.debug("%s not shared: %s", what, exc)
        return None
    if not is_full_attention_cache(cache, longest):
        log.debug("%s not shared: %s cannot serve %d tokens as full attention", what, type(cache).__name__, longest)
        return None
    return cache


def shared_prompt_cache(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, group_size: int, max_new_tokens: int
):
    """Each prompt but its last token run once, the KV cache repeated over its group: `generate` then
    continues from the last prompt token. Without it every prompt is prefilled `group_size` times, which
    on short-answer mixes is most of a round's generation. None when the model's cache cannot be shared
    for prompts and `max_new_tokens` more."""
    if group_size < 2 or ids.shape[1] < 2:
        return None
    positions = generate_positions(attn)
    cache = _reusable_cache(
        model,
        "prompt prefill",
        ids.shape[1] + max_new_tokens,
        input_ids=ids[:, :-1],
        attention_mask=attn[:, :-1],
        position_ids=positions[:, :-1],
    )
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
    def build(cls, model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> CommonPrefix | None:
        """None when the prompts share too little, or the model's cache cannot be reused this way for the
        longest prompt and `max_new_tokens` more."""
        if not prompts:
            return None
        n, shortest = 0, min(map(len, prompts))
        while n < shortest - 1 and all(p[n] == prompts[0][n] for p in prompts):  # leave every prompt a token
            n += 1
        if n < cls.MIN_TOKENS:
            return None
        device = next(model.parameters()).device
        longest = max(map(len, prompts)) + max_new_tokens  # a batch is [prefix | pad | rest]: its longest prompt
        cache = _reusable_cache(
            model, "common prompt prefix", longest, input_ids=torch.tensor([prompts[0][:n]], device=device)
        )
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
        cache = DynamicCache(
            [(k.expand(B, -1, -1, -1).contiguous(), v.expand(B, -1, -1, -1).contiguous()) for k, v in self.layers]
        )
        return ids.to(device), attn.to(device), cache
