"""GRPO in one place: group-relative advantages, the zero-advantage filter and the clipped loss.

Notation (per completion token t of sequence i):
    ratio_it  = exp(logp_it - old_logp_it)               pi_theta / pi_old, pi_old fixed before step 1
    surrogate = min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)
    kl_it     = exp(ref - logp) - (ref - logp) - 1       k3 estimator, only when beta > 0
    per_token = -(surrogate - beta * kl) * w_i
    w_i       = 1, except for another peer's completion under --external-loss is/ftis (external_weight below)
Aggregation over masked tokens:
    grpo    : mean over tokens of each sequence, then mean over sequences
    dr_grpo : sum over all tokens / (num_sequences * max_completion_len)   (no length bias)
    dapo    : sum over all tokens / number of tokens                      (token-level mean)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node.learn.choices import EXTERNAL_LOSSES, LOSS_TYPES


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
    seq_weight: torch.Tensor | None = None,  # [B] in [0, 1], no grad: how much each completion counts
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
    if seq_weight is not None:
        per_token = per_token * seq_weight.detach().to(logp.dtype).unsqueeze(1)

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


# --- another peer's completions: how they are trained on (--external-loss) ------------------------------
#
# SAPO trains on them as if this node had sampled them (`sapo`): pi_old is our own model on the re-encoded
# text, so the ratio starts at 1 and a completion with negative advantage is pushed down however unlikely
# our model was to write it. The other rules treat them as another policy's samples:
#   positive: only completions with positive advantage (advantages over the whole group) enter the update;
#             left out, not weighted 0, so they cost no forward pass (TOPR, F-TIS's filter)
#   is:       every completion, weighted by the truncated importance ratio min(1, pi_old / mu) of
#             length-normalised sequence probabilities, mu the publisher's (HACPO's ratio clipped at 1);
#             a group sent without mu falls back to `positive`
#   ftis:     both: positive completions only, each weighted by that ratio (F-TIS)
# A weight never exceeds 1, so no log-prob a publisher sends gives its completion more weight than `sapo`.


def keeps_external(external_loss: str, advantage: float, has_behaviour: bool) -> bool:
    """Whether another peer's completion with this advantage enters the update under `external_loss`."""
    if external_loss not in EXTERNAL_LOSSES:
        raise ValueError(f"external loss must be one of {EXTERNAL_LOSSES}, got {external_loss!r}")
    if external_loss == "sapo" or (external_loss == "is" and has_behaviour):
        return True
    return advantage > 0


def weighs_external(external_loss: str) -> bool:
    """Whether `external_loss` weights another peer's completions by the publisher's behaviour log-probs."""
    return external_loss in ("is", "ftis")


def external_weight(old_mean_logp: torch.Tensor, behaviour_mean_logp: torch.Tensor) -> torch.Tensor:
    """min(1, exp(mean log pi_old - mean log mu)) per sequence: the truncated importance weight of a
    completion that another policy (mu) sampled, on length-normalised log-probs so that it compares across
    tokenizers. A NaN (a malformed mu never gets here: the wire refuses it) counts as weight 0."""
    log_ratio = (old_mean_logp.to(torch.float64) - behaviour_mean_logp.to(torch.float64)).clamp(max=0.0)
    return torch.nan_to_num(torch.exp(log_ratio), nan=0.0)
