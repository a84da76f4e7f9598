"""GRPO loss and gradients against an independent float64 reference written from the formulas."""

import math

import pytest
import torch

from node.learn.grpo import group_advantages, grpo_loss, has_signal


def reference_loss(logp, old, adv, lengths, eps_low, eps_high, loss_type, max_len, beta=0.0, ref=None):
    """Plain Python loops over tokens, float64; padding is simply never visited."""
    per_seq_sums, per_seq_counts = [], []
    for i, n in enumerate(lengths):
        s = 0.0
        for t in range(n):
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            term = -min(ratio * adv[i], clipped * adv[i])
            if beta:
                d = ref[i][t] - logp[i][t]
                term += beta * (math.exp(d) - d - 1)
            s += term
        per_seq_sums.append(s)
        per_seq_counts.append(n)
    if loss_type == "grpo":
        return sum(s / n for s, n in zip(per_seq_sums, per_seq_counts)) / len(lengths)
    if loss_type == "dr_grpo":
        return sum(per_seq_sums) / (len(lengths) * max_len)
    return sum(per_seq_sums) / sum(per_seq_counts)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 7, 1]
    B, T = len(lengths), max(lengths)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # pi_old differs from pi_theta by up to +-0.6 in log space: ratios fall outside [0.8, 1.28] both ways
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.2
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = torch.where(mask.bool(), logp, torch.full_like(logp, 123.0))  # garbage in padding
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64)
    return logp, old, adv, mask, lengths


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradients_match_reference(loss_type, beta):
    logp, old, adv, mask, lengths = make_batch()
    ratio = torch.exp(logp - old)[mask.bool()]
    assert (ratio < 0.8).any() and (ratio > 1.28).any(), "both clip sides must be exercised"
    ref = logp.detach() - 0.1
    max_len = 9
    x = logp.clone().requires_grad_(True)
    loss, stats = grpo_loss(x, old, adv, mask, 0.2, 0.28, loss_type, beta, ref if beta else None, max_len)
    loss.backward()

    L, OLD, R = logp.tolist(), old.tolist(), ref.tolist()
    expected = reference_loss(L, OLD, adv.tolist(), lengths, 0.2, 0.28, loss_type, max_len, beta, R)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)

    # finite-difference gradients on every real token; padding gets exactly zero gradient
    h = 1e-6
    for i, n in enumerate(lengths):
        for t in range(n):
            up = [row[:] for row in L]
            dn = [row[:] for row in L]
            up[i][t] += h
            dn[i][t] -= h
            fd = (
                reference_loss(up, OLD, adv.tolist(), lengths, 0.2, 0.28, loss_type, max_len, beta, R)
                - reference_loss(dn, OLD, adv.tolist(), lengths, 0.2, 0.28, loss_type, max_len, beta, R)
            ) / (2 * h)
            assert x.grad[i, t].item() == pytest.approx(fd, rel=1e-5, abs=1e-8)
    assert torch.all(x.grad[~mask.bool()] == 0)
    assert 0.0 < stats.clip_frac < 1.0


def test_clipped_tokens_have_zero_gradient():
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, 0.05]], dtype=torch.float64)  # ratio e^1 = 2.7 (clipped), e^-0.05 (not)
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64))
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() != 0.0
    assert stats.clip_frac == pytest.approx(0.5)


def test_ratio_one_gives_policy_gradient():
    """With pi_old == pi_theta the GRPO gradient is -A/n per token."""
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.1]], dtype=torch.float64)).requires_grad_(True)
    loss, _ = grpo_loss(
        logp, logp.detach(), torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    )
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 3), -2.0 / 3, dtype=torch.float64))


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    assert group_advantages(r, scale_std=False).tolist() == [0.5, -0.5, -0.5, 0.5]
    scaled = group_advantages(r, scale_std=True, eps=0.0)
    assert scaled.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert not has_signal([0.3, 0.3, 0.3])
    assert has_signal([0.0, 0.0, 1.0])


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), loss_type="ppo")
