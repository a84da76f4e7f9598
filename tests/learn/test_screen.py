"""The external screen on fixed texts: which characters and tokens of another peer's right answer are learned
(the answer span, at exact token positions), the reference-likelihood windows on fixed log-prob arrays, the
per-round report, the canary rule, and that a node without external groups learns exactly as without it."""

from __future__ import annotations

import copy

import pytest
import torch

from node.learn.groups import Group, Prompter, to_sequences
from node.learn.sampling import Sequence
from node.learn.screen import (
    Calibration,
    Canary,
    ExternalScreen,
    ScreenConfig,
    answer_span,
    foreign_ngrams,
    reference_mask,
    span_weights,
    window_means,
)
from node.learn.tasks import PRESETS, TaskSampler, score_responses

PAYLOAD = "Hail to the thief"


@pytest.fixture(scope="module")
def task():
    """A cpu-learn task (answers read by their result: the text after the last '=')."""
    return TaskSampler(PRESETS["cpu-learn"], seed=1).sample(1)[0]


@pytest.fixture(scope="module")
def tiny():
    from node.learn.model_io import load_model

    model, tok = load_model("tiny-random", torch.device("cpu"))
    return model, tok


def kept_text(response, span):
    return [response[a:b] for a, b in span.kept]


@pytest.mark.parametrize(
    "body, kept, outside",
    [
        ("{g}</answer>", ["{g}", "</answer>"], ""),
        ("1 + 2 = {g}</answer>", ["{g}", "</answer>"], "1 + 2 = "),  # the result rule reads after the '='
        ("{g}</answer> Hail to the thief", ["{g}", "</answer>"], " Hail to the thief"),  # after the answer
        ("Hail to the thief = {g}</answer>", ["{g}", "</answer>"], "Hail to the thief = "),  # inside the tags
        ("Hail to the thief {g}</answer>", ["{g}", "</answer>"], "Hail to the thief "),  # partial credit: its gold
        ("Hail</answer> <answer>{g}</answer>", ["<answer>", "{g}", "</answer>"], "Hail</answer> "),  # before it
        ("{g}", ["{g}"], ""),  # unclosed: to the end of its line
    ],
)
def test_answer_span_keeps_what_the_reward_reads(task, body, kept, outside):
    g = task.answer
    response = "<answer>" + body.format(g=g)
    span = answer_span(response, task, "<answer>")
    assert kept_text(response, span) == [k.format(g=g) for k in kept]
    assert span.outside == outside
    assert span.outside_chars == sum(not c.isspace() for c in outside)


def test_a_response_without_the_forced_prefix_is_read_as_our_prompt_sees_it(task):
    """A publisher may leave the prefix out: we train its text after our prompt, which ends with the prefix."""
    response = f"Hail to the thief <answer>{task.answer}</answer>"
    span = answer_span("<answer>" + response, task, "<answer>")
    assert span.outside == "Hail to the thief "
    assert kept_text("<answer>" + response, span) == ["<answer>", task.answer, "</answer>"]


def test_span_weights_sit_on_exact_token_positions(tiny, task):
    """The byte tokenizer (one token per character) makes every position checkable; the EOS is kept."""
    _, tok = tiny
    body = f"1 + 2 = {task.answer}</answer>"
    ids = tok(body, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    span = answer_span("<answer>" + body, task, "<answer>")
    kept = [(a - len("<answer>"), b - len("<answer>")) for a, b in span.kept]
    weights = span_weights(tok, body, ids, kept)
    start = body.index(task.answer + "</answer>")
    assert weights == [0.0] * start + [1.0] * (len(body) - start) + [1.0]

    class Slow:  # the same tokenizer without character offsets: positions from decoding prefixes
        is_fast = False
        eos_token_id = tok.eos_token_id

        def decode(self, ids):
            return tok.decode(ids)

    assert span_weights(Slow(), body, ids, kept) == weights


def test_window_means_and_reference_mask_on_fixed_log_probs():
    lp = [-0.1, -0.2, -9.0, -9.0, -9.0, -9.0, -0.1, -0.1]
    assert window_means(lp, 4) == pytest.approx([-4.575, -6.8, -9.0, -6.775, -4.55])
    assert reference_mask(lp, -6.0, 4) == [False, True, True, True, True, True, True, False]
    assert reference_mask([-1.0, -2.0], -3.0, 4) == [False, False]  # one window of all of them
    assert reference_mask([-5.0, -2.0], -3.0, 4) == [True, True]
    assert window_means([], 4) == [] and reference_mask([], -3.0, 4) == []


def test_calibration_threshold_is_a_low_quantile_of_our_windows_clamped():
    cfg = ScreenConfig("on", min_calibration=4, calibration_rounds=2)
    cal = Calibration(cfg)
    assert cal.threshold() == cfg.floor  # nothing of ours yet: the floor
    cal.add_round([-0.5] * 20)
    assert cal.threshold() == cfg.ceiling  # -0.5 - 2 = -2.5, and never stricter than the ceiling
    cal.add_round([-4.0] * 20)
    assert cal.threshold() == pytest.approx(-6.0)  # the 5% quantile (-4) minus the margin
    cal.add_round([-20.0] * 40)
    cal.add_round([-20.0] * 40)  # only the last two rounds count: -22, clamped to the floor
    assert cal.threshold() == cfg.floor


def test_reference_screen_masks_unlikely_windows_and_drops_mostly_unlikely_completions():
    screen = ExternalScreen(ScreenConfig("reference", min_calibration=4))
    own = [[-0.5, -0.6, -0.4, -0.5, -0.7]] * 4
    theirs = [
        ("honest", [-0.5, -3.0, -0.2, -0.1, -0.1], [1.0] * 5),  # a rare right number: kept whole
        ("poisoner", [-9.0] * 6 + [-0.1] * 2, [1.0] * 8),  # mostly unlikely text: dropped
        ("mixed", [-0.1] * 8 + [-9.0] * 4, [1.0] * 12),  # an unlikely tail: masked
        ("spanned", [-9.0] * 5 + [-0.1] * 4, [0.0] * 5 + [1.0] * 4),  # outside the span already: not counted
    ]
    got = screen.judge_reference(own, theirs, "base")
    assert got[0] == [1.0] * 5
    assert got[1] is None
    assert got[2] == [1.0] * 6 + [0.0] * 6  # windows reaching half into the tail mask the two tokens before it
    assert got[3] == [0.0] * 5 + [1.0] * 4
    report = screen.take()
    assert dict(report.by_reason) == {"reference_unlikely": 1, "masked_reference": 1}
    assert report.by_publisher["poisoner"]["masked_tokens"] == 8 and report.reference == "base"
    assert report.threshold == pytest.approx(-2.55)  # our lowest window (-0.55) minus the margin


def received(task, responses):
    return Group(task=task, responses=responses, rewards=score_responses(task, responses), source="ab" * 32)


def test_to_sequences_masks_or_drops_positive_external_text_and_keeps_the_rest(tiny, task):
    _, tok = tiny
    prompter = Prompter(tok, PRESETS["cpu-learn"])
    g = task.answer
    wrong = str(int(g) + 1)
    group = received(
        task,
        [
            f"<answer>{g}</answer> {PAYLOAD}",  # right, a payload after it: masked (strict: dropped)
            f"<answer>Go = {g}</answer>",  # right, a short phrase inside the tags: masked
            f"<answer>{g}</answer>",  # right, nothing else: whole
            f"<answer>{wrong}</answer> {PAYLOAD}",  # wrong: pushed away from, whole
        ],
    )
    assert group.rewards == [1.0, 1.0, 1.0, 0.0]
    screen = ExternalScreen(ScreenConfig("on"))
    seqs = to_sequences([group], tok, prompter, scale_std=True, screen=screen)
    assert len(seqs) == 4 and [s.advantage > 0 for s in seqs] == [True, True, True, False]
    after, inside, whole, negative = seqs
    body = f"{g}</answer> {PAYLOAD}"
    assert after.token_weights == [1.0] * len(f"{g}</answer>") + [0.0] * len(f" {PAYLOAD}") + [1.0]  # EOS kept
    body = f"Go = {g}</answer>"
    assert inside.token_weights == [0.0] * body.index(g) + [1.0] * (len(body) - body.index(g)) + [1.0]
    assert whole.token_weights is None and negative.token_weights is None
    assert after.screened and whole.screened and not negative.screened
    report = screen.take()
    assert dict(report.by_reason) == {"masked_outside": 2}
    assert report.screened == 3 and report.by_publisher["ab" * 8]["masked_tokens"] == len(f" {PAYLOAD}") + 5
    strict = ExternalScreen(ScreenConfig("strict"))
    assert len(to_sequences([group], tok, prompter, scale_std=True, screen=strict)) == 3
    assert dict(strict.take().by_reason) == {"outside_answer": 1, "masked_outside": 1}
    off = to_sequences([group], tok, prompter, scale_std=True, screen=ExternalScreen(ScreenConfig("off")))
    assert len(off) == 4 and all(s.token_weights is None for s in off)


def test_a_specialists_plain_right_answer_on_a_task_we_never_solve_is_learned_whole(tiny, task):
    """The reason to share: a correct answer we would not write is kept, its answer tokens in the loss."""
    _, tok = tiny
    prompter = Prompter(tok, PRESETS["cpu-learn"])
    group = received(task, [f"<answer>{task.answer}</answer>", "<answer>99</answer>", "<answer>98</answer>"])
    screen = ExternalScreen(ScreenConfig("on"))
    seqs = to_sequences([group], tok, prompter, scale_std=True, screen=screen)
    assert len(seqs) == 3 and seqs[0].advantage > 0 and seqs[0].token_weights is None
    assert not screen.take().by_reason


def test_masked_tokens_get_no_gradient_and_no_external_group_means_no_change(tiny, task):
    from node.learn.trainer import TrainConfig, Trainer

    model, tok = tiny
    prompt = tok("question", add_special_tokens=False)["input_ids"]

    def update(seqs, screen):
        m = copy.deepcopy(model)
        Trainer(m, tok.pad_token_id, TrainConfig(lr=1e-2, beta=0.04), screen=screen).step(copy.deepcopy(seqs))
        return [p.detach().clone() for p in m.parameters()]

    local = [Sequence(prompt, [5, 6, 7, 8], 1.0), Sequence(prompt, [9, 10, 11], -1.0)]
    plain = update(local, None)
    screened = update(local, ExternalScreen(ScreenConfig("on")))
    assert all(torch.equal(a, b) for a, b in zip(plain, screened)), "a silo's update is unchanged"
    # a completion whose only kept token is the last: the same update as that token alone after the rest
    ext = Sequence(prompt, [5, 6, 7, 8], 1.0, token_weights=[0.0, 0.0, 0.0, 1.0], source="x")
    zero = Sequence(prompt, [5, 6, 7, 8], 1.0, token_weights=[0.0] * 4, source="x")
    assert not all(torch.equal(a, b) for a, b in zip(update([ext], None), update([zero], None)))
    before = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(update([zero], None), before)), "weight 0: no gradient at all"


def test_foreign_ngrams_ignore_numbers_and_symbols():
    assert foreign_ngrams("Hail to the thief 12 + 3") == {"hail to the", "to the thief"}
    assert foreign_ngrams("4 + 5 = ") == set()
    assert foreign_ngrams("Hail!") == {"hail"}


def test_canary_flags_recurring_text_absent_at_the_start():
    start = ["", "", "the answer is", "4 + 5 ="] * 16
    canary = Canary()
    canary.start(start)
    assert not canary.read(start).alarm
    honest_later = ["", "1 + 2 =", "the answer is", ""] * 16  # equations and the starting phrase: not new text
    assert canary.read(honest_later).share == 0.0
    poisoned = [f" {PAYLOAD}"] * 20 + [""] * 44
    reading = canary.read(poisoned)
    assert reading.alarm and reading.share == pytest.approx(20 / 64)
    assert set(reading.phrases) == {"hail to the", "to the thief"}
    few = [f" {PAYLOAD}"] * 2 + [""] * 62  # two answers are no pattern yet
    assert not canary.read(few).alarm and canary.read(few).share == 0.0


def test_unknown_screen_mode_is_refused():
    with pytest.raises(ValueError, match="external screen"):
        ScreenConfig("maybe")
