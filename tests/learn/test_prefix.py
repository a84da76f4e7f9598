"""Shared-prefix GRPO: the same loss and the same gradients as the plain layout, in float64."""

import copy
import types

import pytest
import torch

from conftest import tiny_gemma3, tiny_signal_groups
from node.learn.groups import Group, Prompter, to_sequences
from node.learn.model_io import load_model
from node.learn.prefix import micro_batches, plan_units, split_completions, supports_prefix_sharing, token_budget
from node.learn.sampling import SamplingConfig, Sequence, sample_groups, token_logprobs
from node.learn.tasks import PRESETS, TaskSampler
from node.learn.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def tiny64():
    """Tiny random model in float64; three local groups (prompts of different lengths) + one external."""
    model, tok, prompter, _, groups = tiny_signal_groups(seed=11, max_new_tokens=10)
    mix = PRESETS["cpu-easy"]
    extra = TaskSampler(mix, seed=12).sample(1)[0]
    groups.append(
        Group(
            task=extra, responses=["<answer>7</answer>", "<answer>13", "x"], rewards=[1.0, 0.0, 0.2], source="ab" * 32
        )
    )
    model = model.double()
    for module in model.modules():  # HF's RMSNorm rounds to float32 even in a float64 model: keep float64
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = types.MethodType(_rms_norm_float64, module)
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    assert len({len(s.prompt_ids) for s in seqs}) >= 3, "the test needs prompts of different lengths"
    assert any(s.old_logp is None for s in seqs), "the test needs re-encoded external sequences"
    return model, tok, seqs


def _rms_norm_float64(self, hidden):
    return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def _grads(model, tok, seqs, shared, **cfg):
    m = copy.deepcopy(model)
    trainer = Trainer(
        m, tok.pad_token_id, TrainConfig(lr=0.0, max_grad_norm=1e9, prefix_sharing="on" if shared else "off", **cfg)
    )
    seqs = copy.deepcopy(seqs)
    trainer.fill_old_logp(seqs)
    # pi_old made different from pi_theta, so the clipped branch is exercised too
    for s in seqs:
        s.old_logp = [x + 0.3 * ((i % 3) - 1) for i, x in enumerate(s.old_logp)]
    stats = trainer._optimizer_step(seqs, trainer._ref_logprobs(seqs))
    return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]), stats


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("micro", [1, 3, 5, 64])
def test_shared_prefix_gradients_equal_plain(tiny64, loss_type, micro):
    model, tok, seqs = tiny64
    order = [seqs[i] for i in torch.randperm(len(seqs), generator=torch.Generator().manual_seed(micro)).tolist()]
    plain, st_plain = _grads(model, tok, order, shared=False, loss_type=loss_type, micro_batch_size=micro)
    shared, st_shared = _grads(model, tok, order, shared=True, loss_type=loss_type, micro_batch_size=micro)
    assert plain.dtype == torch.float64 and plain.abs().max() > 1e-6
    assert (plain - shared).abs().max() < 1e-9
    assert abs(st_plain["loss"] - st_shared["loss"]) < 1e-9
    assert abs(st_plain["clip_frac"] - st_shared["clip_frac"]) < 1e-9 and st_plain["clip_frac"] > 0


def test_shared_prefix_gradients_equal_plain_with_kl(tiny64):
    model, tok, seqs = tiny64
    plain, _ = _grads(model, tok, seqs, shared=False, beta=0.1, micro_batch_size=4)
    shared, _ = _grads(model, tok, seqs, shared=True, beta=0.1, micro_batch_size=4)
    assert (plain - shared).abs().max() < 1e-9


def test_shared_logprobs_equal_plain_per_sequence(tiny64):
    model, tok, seqs = tiny64
    with torch.no_grad():
        plain, mask = token_logprobs(model, seqs, tok.pad_token_id, 0.7)
        by_seq = {
            id(s): (row, m)
            for chunk, lp, mk in micro_batches(model, seqs, tok.pad_token_id, 0.7, 5, True)
            for s, row, m in zip(chunk, lp, mk)
        }
    for s, row, m in zip(seqs, plain, mask):
        n = int(m.sum())
        other, other_mask = by_seq[id(s)]
        assert int(other_mask.sum()) == n == len(s.completion_ids)
        assert (row[:n] - other[:n]).abs().max() < 1e-10


def test_units_keep_groups_whole_and_split_big_ones():
    a, b, c = [1, 2], [1, 2, 3], [4]
    seqs = [Sequence(p, [9], 0.0) for p in (a, b, a, c, b, a, a, a)]
    units = plan_units(seqs, budget=9)  # a: 2 + 5 x 1 tokens; b + c: 2 x 3 (padded prompts) + 3 x 1
    assert [u.prompts for u in units] == [[tuple(a)], [tuple(b), tuple(c)]]
    assert units[0].members == [[0, 2, 5, 6, 7]] and units[1].members == [[1, 4], [3]]
    assert split_completions([1, 1, 5, 1], 6) == [2, 1, 1]  # padded: 3 x 5 > 6
    assert split_completions([7], 6) == [1]  # one completion always runs, even past the budget

    seqs = [Sequence(p, [9] * (3 if p is a else 1), 0.0) for p in (a, b, a, c, b, a, a, a)]
    assert token_budget(seqs, 2) == 10  # two plain sequences of the longest: 2 x (2 + 3)
    chunks = [
        len(ch) for ch, _, _ in micro_batches(load_model("tiny-random", torch.device("cpu"))[0], seqs, 0, 1.0, 2, True)
    ]
    # a (2 + 5 x 3 > 10) is a unit of its own: 8 tokens of room for its completions, two at a time;
    # b and c share one unit and one pass (2 x 3 + 3 x 1 <= 10)
    assert chunks == [2, 2, 1, 3]


def test_auto_picks_shared_for_llama_and_plain_for_a_model_without_a_cache(tiny64):
    model, tok, _ = tiny64
    assert supports_prefix_sharing(model, tok.pad_token_id)

    class NoCache(torch.nn.Module):  # a causal LM whose forward has no past_key_values
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, input_ids, attention_mask, position_ids, use_cache=False, logits_to_keep=0):
            return self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=logits_to_keep,
            )

    wrapped = NoCache(model)
    assert not supports_prefix_sharing(wrapped, tok.pad_token_id)
    assert Trainer(wrapped, tok.pad_token_id, TrainConfig()).shared_prefix is False
    with pytest.raises(ValueError, match="cannot be shared"):
        _ = Trainer(wrapped, tok.pad_token_id, TrainConfig(prefix_sharing="on")).shared_prefix


def gemma64(vocab: int, window: int) -> torch.nn.Module:
    """conftest's tiny Gemma 3 in float64."""
    torch.manual_seed(5)
    model = tiny_gemma3(vocab, window).double()
    for module in model.modules():  # Gemma's RMSNorm rounds to float32 too: keep float64
        if type(module).__name__ == "Gemma3RMSNorm":
            module.forward = types.MethodType(lambda self, x: self._norm(x) * (1.0 + self.weight), module)
    return model


@pytest.mark.parametrize("window", [512, 64])
def test_a_sliding_window_model_shares_while_the_update_fits_its_window(tiny64, window, monkeypatch):
    """Gemma 3's sliding layers attend fully over sequences that fit the window: the prompt then runs once
    per group with the plain layout's gradients; an update with a longer sequence runs plain, just as exact."""
    import node.learn.prefix as prefix_mod

    _, tok, seqs = tiny64
    model = gemma64(len(tok), window)
    longest = max(len(s.prompt_ids) for s in seqs) + max(len(s.completion_ids) for s in seqs)
    assert max(len(s.prompt_ids) for s in seqs) > 64 and longest <= 512  # one window fits, the other does not
    assert supports_prefix_sharing(model, tok.pad_token_id)  # the probe's sequences fit either window
    built = []  # the prompts of every prefix run as a SharedPrefix
    monkeypatch.setattr(prefix_mod.SharedPrefix, "__init__", _counting(prefix_mod.SharedPrefix.__init__, built))
    plain, _ = _grads(model, tok, seqs, shared=False, micro_batch_size=3)
    assert not built
    shared, _ = _grads(model, tok, seqs, shared=True, micro_batch_size=3)
    # the trainer's probe (short sequences) shares either way; the update's own prompts only when they fit
    assert any(max(map(len, prompts)) > 64 for prompts in built) == (window == 512)
    assert plain.abs().max() > 1e-6 and (plain - shared).abs().max() < 1e-9


def _counting(init, calls: list):
    def wrapped(self, model, prompts, *args, **kwargs):
        calls.append(prompts)
        init(self, model, prompts, *args, **kwargs)

    return wrapped


@pytest.mark.parametrize("model_kind", ["llama", "gemma", "gemma past its window"])
def test_generation_prefills_each_prompt_once_with_the_same_samples(tiny64, model_kind):
    """Prompts of different lengths (left padding): one prefill per prompt, the same tokens and behaviour
    log-probs as prefilling every completion's own copy, for the same seed. A sliding-window model shares
    while prompt and answer fit its window, and prefills every completion past it."""
    model, tok, _ = tiny64
    if model_kind != "llama":
        model = gemma64(len(tok), 512 if model_kind == "gemma" else 64)
    mix = PRESETS["cpu-easy"]
    prompter = Prompter(tok, mix)
    prompts = [prompter(t) for t in TaskSampler(mix, seed=21).sample(3)]
    assert len({len(tok(p)["input_ids"]) for p in prompts}) > 1
    calls = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    try:
        runs = {}
        for share in (True, False):
            calls.clear()
            torch.manual_seed(3)
            runs[share] = (
                sample_groups(model, tok, prompts, 4, SamplingConfig(max_new_tokens=6), share_prompt=share),
                list(calls),
            )
    finally:
        hook.remove()
    (shared, shared_calls), (plain, plain_calls) = runs[True], runs[False]
    # prefill batch: prompts, not completions
    assert shared_calls[0][0] == (12 if model_kind == "gemma past its window" else 3) and plain_calls[0][0] == 12
    for a, b in zip(shared, plain):
        assert a.completion_ids == b.completion_ids and a.prompt_ids == b.prompt_ids
        for x, y in zip(a.behaviour_logp, b.behaviour_logp):
            assert max(abs(u - v) for u, v in zip(x, y)) < 1e-9


def test_cache_passes_under_the_installed_transformers_name(caplog):
    """Sampling, the shared-prefix update and greedy evaluation hand the KV cache over under the name the
    installed transformers takes: no deprecation warning (the old name goes in transformers 5.40)."""
    from transformers.utils import logging as hf_logging

    from node.learn.evaluate import greedy_texts

    hf_logging.get_logger("x").warning_once.__func__.cache_clear()  # warning_once says each message once a process
    hf_logging.enable_propagation()
    with caplog.at_level("WARNING"):
        model, tok, prompter, tasks, groups = tiny_signal_groups(seed=3, max_new_tokens=4)
        seqs = to_sequences(groups, tok, prompter, scale_std=True)
        assert list(micro_batches(model, seqs, tok.pad_token_id, 1.0, 4, True))
        assert len(greedy_texts(model, tok, [prompter(t) for t in tasks], 4, 2)) == 3
    cache_warnings = [r.getMessage() for r in caplog.records if "past_key_values" in r.getMessage()]
    assert cache_warnings == []
