"""An external completion costs a bounded number of tokens to train on, whatever its text."""

import logging

import torch

from node.learn.groups import Group, Prompter, external_token_cap, to_sequences
from node.learn.model_io import load_model
from node.learn.tasks import PRESETS, TaskSampler


def test_a_long_external_completion_is_cut_to_the_cap(caplog):
    """8000 code points (the wire's cap) can be tens of thousands of tokens of ours: the node trains on the
    first `max_external_tokens` (no EOS: the text went on), says so, and leaves short completions whole."""
    _, tok = load_model("tiny-random", torch.device("cpu"))
    mix = PRESETS["cpu-easy"]
    task = TaskSampler(mix, seed=3).sample(1)[0]
    long_text = "<answer>" + "\U0001f9ea" * 8000
    group = Group(task=task, responses=[long_text, "<answer>7</answer>"], rewards=[0.0, 1.0], source="ab" * 32)
    whole = to_sequences([group], tok, Prompter(tok, mix), scale_std=True)
    assert len(whole[0].completion_ids) > 8000  # the text as our tokenizer reads it
    cap = external_token_cap(mix.max_new_tokens)
    with caplog.at_level(logging.WARNING, logger="sapo.node"):
        seqs = to_sequences([group], tok, Prompter(tok, mix), scale_std=True, max_external_tokens=cap)
    assert [len(s.completion_ids) for s in seqs] == [cap, len(whole[1].completion_ids)]
    assert seqs[0].completion_ids == whole[0].completion_ids[:cap] and seqs[1] == whole[1]
    assert "1 external completions cut to their first 256 tokens" in caplog.text
