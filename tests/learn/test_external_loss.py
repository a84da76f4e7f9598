"""--external-loss: which of another peer's completions enter the update, and with what weight, against a
float64 reference written from the formulas; no behaviour log-prob a publisher sends can give a completion more
weight than the paper's rule (`sapo`) gives it."""

import math

import pytest
import torch
from test_grpo import make_batch, reference_loss

from node.learn.choices import EXTERNAL_LOSSES
from node.learn.grpo import external_weight, group_advantages, grpo_loss, keeps_external, weighs_external


def reference_weighted_loss(logp, old, adv, lengths, weights, loss_type, max_len, beta=0.0, ref=None):
    """The GRPO reference with each sequence's per-token terms multiplied by its weight (float64 loops)."""
    per_seq = []
    for i, n in enumerate(lengths):
        one = reference_loss(
            [logp[i]], [old[i]], [adv[i]], [n], 0.2, 0.28, "dapo", max_len, beta, [ref[i]] if ref else None
        )  # dapo of one sequence: its per-token mean
        per_seq.append((weights[i] * one * n, n))
    if loss_type == "grpo":
        return sum(s / n for s, n in per_seq) / len(lengths)
    if loss_type == "dr_grpo":
        return sum(s for s, _ in per_seq) / (len(lengths) * max_len)
    return sum(s for s, _ in per_seq) / sum(n for _, n in per_seq)


def reference_weight(old_mean: float, mu: float) -> float:
    return 1.0 if old_mean >= mu else math.exp(old_mean - mu)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_weighted_loss_and_gradients_match_reference(loss_type, beta):
    logp, old, adv, mask, lengths = make_batch(seed=3)
    weights = torch.tensor([1.0, 0.25, 0.0, 0.7], dtype=torch.float64)
    ref = logp.detach() - 0.1
    x = logp.clone().requires_grad_(True)
    loss, _ = grpo_loss(x, old, adv, mask, 0.2, 0.28, loss_type, beta, ref if beta else None, 9, weights)
    loss.backward()
    args = (old.tolist(), adv.tolist(), lengths, weights.tolist(), loss_type, 9, beta, ref.tolist() if beta else None)
    assert loss.item() == pytest.approx(reference_weighted_loss(logp.tolist(), *args), rel=1e-12, abs=1e-12)
    h = 1e-6
    for i, n in enumerate(lengths):
        for t in range(n):
            up, dn = [row[:] for row in logp.tolist()], [row[:] for row in logp.tolist()]
            up[i][t] += h
            dn[i][t] -= h
            fd = (reference_weighted_loss(up, *args) - reference_weighted_loss(dn, *args)) / (2 * h)
            assert x.grad[i, t].item() == pytest.approx(fd, rel=1e-5, abs=1e-8)
    assert torch.all(x.grad[2] == 0), "a weight of 0 leaves a completion out of the gradient"


def test_external_weight_matches_reference_and_is_truncated_at_one():
    old_mean = torch.tensor([-0.5, -2.0, -0.1, -3.0], dtype=torch.float64)
    mu = torch.tensor([-1.0, -0.2, -0.1, -900.0], dtype=torch.float64)
    got = external_weight(old_mean, mu).tolist()
    assert got == pytest.approx([reference_weight(o, m) for o, m in zip(old_mean.tolist(), mu.tolist())], rel=1e-12)
    assert got[0] == 1.0 and got[3] == 1.0 and got[1] == pytest.approx(math.exp(-1.8))


def test_no_behaviour_log_prob_gives_more_weight_than_the_paper_rule():
    """Whatever mu a publisher claims (extremes included), every token's gradient under is/ftis is the paper
    rule's gradient times a factor in [0, 1]: a lie can only lower the weight of the liar's own completions."""
    logp, old, adv, mask, lengths = make_batch(seed=5)
    gen = torch.Generator().manual_seed(9)
    claims = [torch.full((4,), v, dtype=torch.float64) for v in (0.0, -1e-9, -1000.0, -1e300)]
    claims += [-torch.rand(4, generator=gen, dtype=torch.float64) * 20 for _ in range(20)]
    paper = logp.clone().requires_grad_(True)
    grpo_loss(paper, old, adv, mask)[0].backward()
    old_mean = (old * mask).sum(1) / mask.sum(1)
    for mu in claims:
        w = external_weight(old_mean, mu)
        assert torch.all((w >= 0) & (w <= 1))
        x = logp.clone().requires_grad_(True)
        grpo_loss(x, old, adv, mask, seq_weight=w)[0].backward()
        assert torch.all(x.grad.abs() <= paper.grad.abs() + 1e-15)


@pytest.mark.parametrize("rule", EXTERNAL_LOSSES)
def test_which_external_completions_enter_the_update(rule):
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)).tolist()
    for has_mu in (True, False):
        kept = [keeps_external(rule, a, has_mu) for a in adv]
        if rule == "sapo" or (rule == "is" and has_mu):
            assert all(kept)
        else:  # positive, ftis, and is without the publisher's log-probs: the positive ones only
            assert kept == [a > 0 for a in adv] == [True, False, False, True, False, False]
    assert weighs_external(rule) == (rule in ("is", "ftis"))


def test_unknown_external_loss():
    with pytest.raises(ValueError, match="external loss"):
        keeps_external("luffy", 1.0, True)


# --- on a real tiny model: published, verified, re-encoded, weighed ------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_signal_groups

    model, tok, prompter, _, groups = tiny_signal_groups(seed=7, max_new_tokens=6)
    return model, tok, prompter, groups


def received(groups):
    """`groups` as another peer receives them: signed into a batch (with their mean log-probs), verified and
    re-scored by the receiver (rewards forced back to the fixture's, as the random model earns none)."""
    import random

    from node.learn.groups import Group, score_responses
    from node.learn.tasks import PRESETS
    from node.swarm.bandit import PublisherBandit
    from node.swarm.exchange import ExchangeStats
    from node.swarm.reputation import Reputation
    from node.swarm.verify import Verifier, VerifyConfig
    from node.swarm.verify import make_batch as sign_batch
    from p2p.identity import Identity

    honest = [Group(g.task, g.responses, score_responses(g.task, g.responses), sampled=g.sampled) for g in groups]
    data = sign_batch(Identity.generate(), "mem", 0, "tiny", honest)
    cfg = VerifyConfig(swarm="mem")
    reputation = Reputation(cfg.reputation)
    verifier = Verifier(
        Identity.generate().public_key_bytes,
        PRESETS["cpu-easy"],
        cfg,
        ExchangeStats(),
        reputation,
        PublisherBandit(rng=random.Random(0), reputation=reputation),
    )
    got = verifier.verify(data)
    assert len(got) == len(groups)
    for g, original in zip(got, groups):
        g.rewards = list(original.rewards)
    return got


def test_published_log_probs_reach_the_receiver_and_weigh_its_update(tiny):
    model, tok, prompter, groups = tiny
    external = received(groups)
    assert [g.behaviour_mean_logp for g in external] == [[round(x, 4) for x in g.mean_behaviour_logp()] for g in groups]
    by_rule = {rule: to_sequences_for(rule, external, tok, prompter) for rule in EXTERNAL_LOSSES}
    assert len(by_rule["sapo"]) == len(by_rule["is"]) == 12
    assert len(by_rule["positive"]) == len(by_rule["ftis"]) == 6  # rewards [1, 0, .5, 0]: two above the mean
    assert all(s.behaviour_mean_logp is None for s in by_rule["sapo"] + by_rule["positive"])
    assert all(s.behaviour_mean_logp is not None for s in by_rule["is"] + by_rule["ftis"])

    import copy

    from node.learn.sampling import token_logprobs
    from node.learn.trainer import TrainConfig, Trainer

    seqs = by_rule["is"]
    logp, mask = token_logprobs(model, seqs, tok.pad_token_id, 1.0)  # pi_old: the model before the step
    expected = [
        reference_weight(float((row * m).sum() / m.sum()), s.behaviour_mean_logp)
        for s, row, m in zip(seqs, logp.double(), mask.double())
    ]
    stats = Trainer(copy.deepcopy(model), tok.pad_token_id, TrainConfig(lr=1e-3)).step(seqs)
    # the publisher's own model, but re-encoded text (a truncated completion gains an EOS): weights near 1
    assert stats.external_weight == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    assert 0.5 < stats.external_weight <= 1.0
    liar = copy.deepcopy(by_rule["is"])
    for s in liar:
        s.behaviour_mean_logp = 0.0  # "my model was certain of every token": the weight can only fall
    lied = Trainer(copy.deepcopy(model), tok.pad_token_id, TrainConfig(lr=1e-3)).step(liar)
    assert lied.external_weight < 0.1


def to_sequences_for(rule, groups, tok, prompter):
    from node.learn.groups import to_sequences

    return to_sequences(groups, tok, prompter, scale_std=True, external_loss=rule)
