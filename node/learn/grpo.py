"""GRPO in one place: group-relative advantages, the zero-advantage filter and the clipped loss.

Notation (per completion token t of sequence i):
    ratio_it  = exp(logp_it - old_logp_it)               pi_theta / pi_old, pi_old fixed before step 1
    surrogate = min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)
    kl_it     = exp(ref - logp) - (ref - logp) - 1       k3 estimator, only when beta > 0
    per_token = -(surrogate - beta * kl)
Aggregation over masked tokens:
    grpo    : mean over tokens of each sequence, then mean over sequences
    dr_grpo : sum over all tokens / (num_sequences * max_completion_len)   (no length bias)
    dapo    : sum over all tokens / number of tokens                      (token-level mean)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node.learn.choices import LOSS_TYPES


def group_advantages(rewards: torch.Tensor, scale_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """(r - mean(r)) / (std(r) + eps) within one group; Dr. GRPO (scale_std=False) keeps r - mean(r)."""
    centered = rewards - rewards.mean()
    if not scale_std:
        return centered
    return centered / (rewards.std(unbiased=False) + eps)


def has_signal(rewards: list[float] | torch.Tensor, tol: float = 1e-6) -> bool:
    """A group whose rewards are all equal has zero advantage everywhere: it teaches nothing."""
    values = torch.as_tensor(rewards, dtype=torch.float64)
    return bool(values.numel() > 1 and (values.max() - values.min()) > tol)


@dataclass
class LossStats:
    loss: float
    clip_frac: float
    ratio_mean: float
    kl: float
    tokens: int


def grpo_loss(
    logp: torch.Tensor,  # [B, T] log pi_theta of completion tokens
    old_logp: torch.Tensor,  # [B, T] log pi_old, no grad
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1 for completion tokens, 0 for padding
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    loss_type: str = "grpo",
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    max_completion_len: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp.detach())
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if beta > 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        delta = ref_logp.detach() - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + beta * kl

    loss = aggregate(per_token, mask, loss_type, max_completion_len)
    with torch.no_grad():
        n_tokens = mask.sum().clamp(min=1.0)
        is_clipped = ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
        stats = LossStats(
            loss=float(loss.detach()),
            clip_frac=float((is_clipped.to(mask.dtype) * mask).sum() / n_tokens),
            ratio_mean=float((ratio * mask).sum() / n_tokens),
            kl=float((kl * mask).sum() / n_tokens),
            tokens=int(mask.sum()),
        )
    return loss, stats


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_len: int | None) -> torch.Tensor:
    """The loss of `loss_type` (one of LOSS_TYPES: the one place a loss type is checked in learn)."""
    masked = per_token * mask
    if loss_type == "grpo":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.mean()
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * (max_len or per_token.shape[1]))
    if loss_type == "dapo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
