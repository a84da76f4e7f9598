"""The trainer on a real tiny model: pi_old fixed across steps, micro-batching exact, external re-encoding."""

import copy

import pytest
import torch

from conftest import tiny_signal_groups
from node.learn.groups import Group, to_sequences
from node.learn.sampling import token_logprobs
from node.learn.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def tiny():
    model, tok, prompter, _, groups = tiny_signal_groups(seed=5, max_new_tokens=8)
    return model, tok, prompter, groups


def test_behaviour_logp_equals_training_logp_before_any_step(tiny):
    model, tok, prompter, groups = tiny
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    logp, mask = token_logprobs(model, seqs, tok.pad_token_id, 1.0)
    for s, row, m in zip(seqs, logp, mask):
        n = int(m.sum())
        assert torch.allclose(row[:n], torch.tensor(s.old_logp), atol=1e-4)


def test_ratio_departs_from_one_after_first_step(tiny):
    model, tok, prompter, groups = tiny
    model = copy.deepcopy(model)
    trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=5e-2, epochs=3, minibatches=2, micro_batch_size=4))
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    old = [list(s.old_logp) for s in seqs]
    stats = trainer.step(seqs)
    assert stats.optimizer_steps == 6
    assert [s.old_logp for s in seqs] == old  # pi_old never refreshed during the update
    assert abs(stats.ratio_mean - 1.0) > 1e-3
    assert stats.clip_frac > 0.0


def test_micro_batching_gives_the_same_gradient(tiny):
    model, tok, prompter, groups = tiny
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    grads = []
    for micro in (12, 5):
        for loss_type in ("grpo", "dapo", "dr_grpo"):
            m = copy.deepcopy(model)
            t = Trainer(
                m, tok.pad_token_id, TrainConfig(lr=0.0, micro_batch_size=micro, loss_type=loss_type, max_grad_norm=1e9)
            )
            t._optimizer_step(seqs, None)
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    for a, b in zip(grads[:3], grads[3:]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_external_groups_are_reencoded_with_our_tokenizer(tiny):
    model, tok, prompter, groups = tiny
    g = groups[0]
    foreign = Group(task=g.task, responses=["<answer>7</answer>", "<answer>3"], rewards=[1.0, 0.0], source="ab" * 32)
    seqs = to_sequences([foreign], tok, prompter, scale_std=True)
    assert all(s.old_logp is None for s in seqs)
    assert tok.decode(seqs[0].completion_ids, skip_special_tokens=True) == "7</answer>"
    assert seqs[0].completion_ids[-1] == tok.eos_token_id
    assert tok.decode(seqs[0].prompt_ids).endswith("<answer>")
    trainer = Trainer(copy.deepcopy(model), tok.pad_token_id, TrainConfig(lr=1e-3))
    stats = trainer.step(seqs)
    assert stats.optimizer_steps == 1 and stats.tokens > 0
    # one optimizer step: pi_old is that step's own forward, so nothing is filled in and the ratio is 1
    assert all(s.old_logp is None for s in seqs) and abs(stats.ratio_mean - 1.0) < 1e-6 and stats.clip_frac == 0
    trainer.fill_old_logp(seqs)  # several steps per update: one no-grad pass before the first fills them
    assert all(s.old_logp is not None and len(s.old_logp) == len(s.completion_ids) for s in seqs)
