"""The `transformers` sampler as a rollout engine: it samples from the training model itself, so it has
nothing to synchronise and its behaviour log-probs are exact (recorded while sampling), unless mixed
precision makes an incremental decode and the update's full forward round differently (`logp_exact`)."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from node.learn.sampling import SampledGroup, SamplingConfig, sample_groups
from node.learn.stop import StopRequest


class TorchEngine:
    name = "torch"

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, logp_exact: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.logp_exact = logp_exact

    def sync(self, model: torch.nn.Module) -> None:
        self.model = model  # the same module the trainer updates in place: nothing to copy

    def sample(
        self, prompts: list[str], group_size: int, cfg: SamplingConfig, stop: StopRequest | None = None
    ) -> list[SampledGroup]:
        groups = sample_groups(self.model, self.tokenizer, prompts, group_size, cfg, stop)
        for g in groups:
            g.logp_exact = g.logp_exact and self.logp_exact
        return groups

    def close(self) -> None:
        """Nothing to release: the model is the trainer's."""
