"""--practise: a node samples its own tasks from part of its mix only, still accepts peers' groups from the whole
mix (never an evaluation task), and its evaluations, of the whole mix, say how each part fares."""

import pytest

from node.learn.evaluate import EvalResult
from node.learn.practise import parse, practised
from node.learn.tasks import EVAL_INDEX_START, PRESETS, TaskSampler, TaskSpec

SMOKE = PRESETS["smoke"]  # propositional_logic, palindrome_generation
LEARN = PRESETS["cpu-learn"]  # basic_arithmetic, chain_sum; a content split for the unseen set


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", {}),
        ("  ", {}),
        ("chain_sum", {"chain_sum": None}),
        ("basic_arithmetic:1,chain_sum:3", {"basic_arithmetic": 1.0, "chain_sum": 3.0}),
        (" chain_sum : 0.5 , basic_arithmetic ", {"chain_sum": 0.5, "basic_arithmetic": None}),
    ],
)
def test_values_parse(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("chain_sum:0", "needs a positive weight for chain_sum (got '0')"),
        ("chain_sum:-1", "needs a positive weight for chain_sum"),
        ("chain_sum:x", "needs a positive weight for chain_sum (got 'x')"),
        ("chain_sum:inf", "needs a positive weight"),
        ("chain_sum:nan", "needs a positive weight"),
        ("chain_sum:", "needs a positive weight for chain_sum (got '')"),
        ("chain_sum,chain_sum:2", "names chain_sum twice"),
        ("chain_sum,,basic_arithmetic", "not ''"),
        (",", "not ''"),
        ("chain sum", "not 'chain sum'"),
        (":3", "not ':3'"),
    ],
)
def test_malformed_values_are_refused(text, message):
    with pytest.raises(ValueError, match=None) as info:
        parse(text)
    assert message in str(info.value)


def test_the_part_is_checked_against_the_mix():
    assert practised(LEARN, "") == {"basic_arithmetic": 1.0, "chain_sum": 1.0}  # the whole mix, its weights
    assert practised(LEARN, "chain_sum") == {"chain_sum": 1.0}  # the mix's own weight
    # the mix's order, whatever the value's: the same part is the same sampler
    assert list(practised(LEARN, "chain_sum:3,basic_arithmetic")) == ["basic_arithmetic", "chain_sum"]
    assert practised(PRESETS["cpu-easy"], "count_bits")["count_bits"] == 0.3
    for text in ("propositional_logic", "chain_sum,no_such_dataset"):
        with pytest.raises(ValueError) as info:
            practised(LEARN, text)
        assert str(info.value).startswith(text.split(",")[-1] + ": not in the task mix cpu-learn")
        assert "(its datasets: basic_arithmetic, chain_sum)" in str(info.value)


def test_unset_the_sampler_draws_exactly_as_before():
    """The option unset, a sampler draws what a sampler of the whole mix drew before it existed: same datasets,
    same indices, same random stream (scripts/check_equivalence.py checks a whole run)."""
    for mix in (SMOKE, LEARN, PRESETS["cpu-easy"]):
        before, now = TaskSampler(mix, 7), TaskSampler(mix, 7, practised(mix, ""))
        assert [t.spec for t in before.sample(40)] == [t.spec for t in now.sample(40)]
        assert before.state_dict() == now.state_dict()


def test_only_the_practised_datasets_are_drawn_at_their_weights():
    sampler = TaskSampler(LEARN, 3, practised(LEARN, "chain_sum"))
    assert {t.spec.dataset for t in sampler.sample(50)} == {"chain_sum"}
    weighted = TaskSampler(LEARN, 3, practised(LEARN, "basic_arithmetic:1,chain_sum:3"))
    drawn = [t.spec.dataset for t in weighted.sample(400)]
    assert 0.68 < drawn.count("chain_sum") / len(drawn) < 0.82
    assert all(t.spec.index < EVAL_INDEX_START and not LEARN.reserves(t) for t in weighted.sample(100))


def test_a_practising_sampler_resumes_exactly():
    a = TaskSampler(LEARN, 5, practised(LEARN, "chain_sum"))
    a.sample(7)
    b = TaskSampler(LEARN, 5, practised(LEARN, "chain_sum"))
    b.load_state_dict(a.state_dict())
    assert [t.spec for t in a.sample(9)] == [t.spec for t in b.sample(9)]


def test_peers_groups_are_taken_from_the_whole_mix():
    """What the node practises does not narrow what it accepts: the other part's groups are allowed, the
    evaluation range and what lies outside the whole mix are not (TaskMix.allows is the whole mix's)."""
    other = TaskSampler(LEARN, 9, practised(LEARN, "basic_arithmetic")).sample(20)
    assert {t.spec.dataset for t in other} == {"basic_arithmetic"}
    assert all(LEARN.allows(t.spec) for t in other)
    config = LEARN.datasets["basic_arithmetic"]["config"]
    assert not LEARN.allows(TaskSpec.make("basic_arithmetic", config, 9, EVAL_INDEX_START))
    assert not LEARN.allows(TaskSpec.make("propositional_logic", {}, 9, 0))  # outside the whole mix
    assert not LEARN.allows(TaskSpec.make("basic_arithmetic", {}, 9, 0))  # another config


def test_an_evaluation_reports_each_part():
    result = EvalResult(
        accuracy=0.5,
        scores=[1.0, 0.0, 1.0, 1.0, 0.0, 0.0],
        datasets=["chain_sum"] * 3 + ["basic_arithmetic"] * 3,
        size=6,
        unseen=EvalResult(accuracy=0.5, scores=[0.0, 1.0], datasets=["chain_sum", "chain_sum"], size=2),
    )
    part = frozenset({"chain_sum"})
    record = result.to_record(practised=part)
    assert record["eval_accuracy_practised"] == pytest.approx(2 / 3)
    assert record["eval_accuracy_other"] == pytest.approx(1 / 3)
    assert record["eval_unseen_accuracy_practised"] == 0.5
    assert "eval_unseen_accuracy_other" not in record  # no task of the other part in that set
    assert "start_accuracy_practised" in result.to_record("start", part)
    assert not [k for k in result.to_record() if k.endswith(("_practised", "_other"))]  # unset: no new key
    line = result.log_line(3, part)
    assert "practised 0.667, other 0.333)" in line and "unseen accuracy 0.500" in line
    assert "practised" not in result.log_line(3)
