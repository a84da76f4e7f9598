"""The swarm's side of the external screen: a publisher whose right answers keep carrying the same text earns
no credit, loses reputation and counts as useless in the bandit; an honest one, and one whose extra text never
recurs, do not; a long-form mix (no forced answer prefix) or --external-screen off takes no such evidence."""

from __future__ import annotations

import pytest

from node.learn.groups import Group, score_responses
from node.learn.tasks import PRESETS, TaskSampler
from node.swarm.exchange import ExchangeStats
from node.swarm.reputation import PENALTIES
from node.swarm.screening import ForeignText
from node.swarm.verify import Verifier, VerifyConfig, make_batch
from p2p.identity import Identity

MIX = PRESETS["cpu-learn"]
SAMPLER = TaskSampler(MIX, seed=5)


def group(payload: str = "") -> Group:
    task = SAMPLER.sample(1)[0]
    wrong = str(int(task.answer) + 1)
    responses = [f"<answer>{task.answer}</answer>{payload}", f"<answer>{wrong}</answer>"]
    return Group(task, responses, score_responses(task, responses))


def judged(publisher: Identity, payloads: list[str], screen: str = "on"):
    stats = ExchangeStats()
    v = Verifier(Identity.generate().public_key_bytes, MIX, VerifyConfig(swarm="s", external_screen=screen), stats)
    got = [v.verify(make_batch(publisher, "s", r, "m", [group(p)])) for r, p in enumerate(payloads)]
    return v, stats, got


def test_recurring_text_around_right_answers_costs_reputation_and_usefulness():
    poisoner = Identity.generate()
    v, stats, got = judged(poisoner, [" Hail to the thief, always."] * 5)
    assert all(len(g) == 1 for g in got), "accepted: the trainer's screen keeps its text out, not the verifier"
    assert stats.foreign[poisoner.public_key_hex] == 3  # the third group with the phrase and every one after
    assert v.reputation.score(poisoner.public_key_bytes) == pytest.approx(0.2 - 3 * PENALTIES["foreign_text"])
    record = v.bandit.record(poisoner.public_key_bytes)
    assert record is not None and record.ok == 2 and record.bad == 3


def test_honest_answers_and_text_that_never_recurs_are_not_counted():
    honest = Identity.generate()
    v, stats, _ = judged(honest, [""] * 5)
    assert not stats.foreign and v.reputation.score(honest.public_key_bytes) == pytest.approx(0.5)
    varied = Identity.generate()
    words = ["alpha beta gamma", "delta epsilon zeta", "eta theta iota", "kappa lambda mu", "nu xi omicron"]
    v, stats, _ = judged(varied, [f" {w}" for w in words])
    assert not stats.foreign  # the trainer's screen still drops each of these right answers


def test_no_evidence_without_a_span_screen_or_on_a_long_form_mix():
    poisoner = Identity.generate()
    _, stats, _ = judged(poisoner, [" Hail to the thief, always."] * 5, screen="off")
    assert not stats.foreign
    assert not ForeignText("").judge(b"k", group(" Hail to the thief, always."))
