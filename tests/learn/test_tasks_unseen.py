"""The content split: the unseen evaluation asks only facts that no training task and no accepted group asks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.learn.content import arithmetic_key, content_key, key_fraction
from node.learn.groups import Group, score_responses
from node.learn.tasks import (
    EVAL_INDEX_START,
    PRESETS,
    TaskError,
    TaskSampler,
    TaskSpec,
    eval_tasks,
    regenerate,
    resolve_mix,
    validate_mix,
)
from node.swarm.exchange import ExchangeStats
from node.swarm.verify import Verifier, VerifyConfig, make_batch
from p2p.identity import Identity

MIX = PRESETS["cpu-learn"]
ROOT = Path(__file__).resolve().parents[2]


def task_at(dataset: str, seed: int, index: int):
    return regenerate(TaskSpec.make(dataset, MIX.datasets[dataset]["config"], seed, index))


def keys_of(tasks) -> set[str]:
    return {content_key(t.spec.dataset, t.entry) for t in tasks}


def test_the_key_names_the_fact_not_its_phrasing():
    def key(expression: str) -> str | None:
        return arithmetic_key({"metadata": {"expression": expression}})

    assert key("3 + 5") == key("5+3") == key(" 5 +  3 ")  # a sum's terms in any order, any spacing
    assert key("8 - 3") != key("3 - 8") and key("8 - 3") != key("8 + 3")
    assert key("7 - 0") != key("7 + 0")
    assert key("(3 + 5) * 2") == "expr:(3+5)*2" and key("") is None
    assert arithmetic_key({"question": "no metadata"}) is None
    # the same index and seed of both datasets asks the same fact in different words: one key
    a, b = task_at("basic_arithmetic", 4, 17), task_at("chain_sum", 4, 17)
    if a.entry["metadata"]["expression"] == b.entry["metadata"]["expression"]:
        assert a.question != b.question and keys_of([a]) == keys_of([b])
    assert content_key("count_bits", {"metadata": {"expression": "1 + 1"}}) is None  # no key: never reserved


def test_the_split_reserves_about_its_share_of_the_facts_the_same_in_every_process():
    facts = {content_key(d, task_at(d, seed, i).entry) for d in MIX.datasets for seed in (0, 1) for i in range(1500)}
    assert len(facts) > 150  # two terms of 0-10, + and -: about 190 facts
    reserved = {k for k in facts if key_fraction(k) < MIX.unseen_share}
    assert 0.1 < len(reserved) / len(facts) < 0.3
    # a stable hash, not Python's salted hash(): another interpreter with another hash seed reserves the same
    code = (
        "from node.learn.content import key_fraction; import sys; "
        "print(sorted(k for k in sys.stdin.read().split('|') if key_fraction(k) < 0.2))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            input="|".join(sorted(facts)),
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            timeout=60,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and outs.pop().strip() == repr(sorted(reserved))


def test_no_training_task_is_reserved_and_resume_draws_the_same_tasks():
    drawn = []
    for seed in (0, 1, 2):
        sampler = TaskSampler(MIX, seed)
        tasks = sampler.sample(300)
        assert sampler.counter > 300  # reserved indices were skipped, not drawn
        drawn += tasks
        resumed = TaskSampler(MIX, seed)
        resumed.load_state_dict(sampler.state_dict())
        assert [t.spec for t in resumed.sample(20)] == [t.spec for t in sampler.sample(20)]
    assert not any(MIX.reserves(t) for t in drawn)
    unseen = eval_tasks(MIX, 64, unseen=True)
    assert keys_of(unseen) and not keys_of(unseen) & keys_of(drawn)  # no unseen fact was ever trained on
    # the sampler's wrap below the held-out range still holds
    sampler = TaskSampler(MIX, 0)
    sampler.counter = EVAL_INDEX_START - 3
    assert all(t.spec.index < EVAL_INDEX_START for t in sampler.sample(6))


def test_the_eval_sets_split_by_content_and_mixes_without_a_key_have_no_unseen_set():
    seen, unseen = eval_tasks(MIX, 128), eval_tasks(MIX, 128, unseen=True)
    assert len(seen) == len(unseen) == 128
    assert not any(MIX.reserves(t) for t in seen) and all(MIX.reserves(t) for t in unseen)
    assert not keys_of(seen) & keys_of(unseen)
    assert {t.spec.dataset for t in unseen} == set(MIX.datasets)
    assert [t.spec for t in unseen] == [t.spec for t in eval_tasks(MIX, 128, unseen=True)]  # fixed
    for name in ("paper", "cpu-easy", "smoke"):
        mix = PRESETS[name]
        assert not mix.has_unseen() and eval_tasks(mix, 8, unseen=True) == []
    # without a split the held-out set is what it always was: the range's first tasks
    easy = eval_tasks(PRESETS["cpu-easy"], 8)
    assert sorted(t.spec.index - EVAL_INDEX_START for t in easy if t.spec.dataset == "count_bits") == [0, 1]


def test_a_peer_naming_a_reserved_task_is_refused():
    specs = [TaskSpec.make(d, MIX.datasets[d]["config"], 9, i) for d in MIX.datasets for i in range(200)]
    reserved = [s for s in specs if MIX.reserves(regenerate(s))]
    assert reserved and len(reserved) < len(specs)
    assert not any(MIX.allows(s) for s in reserved)
    assert all(MIX.allows(s) for s in specs if s not in reserved)
    assert MIX.allows(TaskSpec.make("chain_sum", MIX.datasets["chain_sum"]["config"], 9, -1)) is True  # bad_task's

    # the verifier (its TaskMix.allows) accepts no group whose task is reserved, from any publisher
    stats = ExchangeStats()
    verifier = Verifier(Identity.generate().public_key_bytes, MIX, VerifyConfig(swarm="s", window=2), stats)
    peer = Identity.generate()
    groups = []
    for spec in specs[:30] + specs[200:230]:  # 60 groups: within one batch's cap
        task = regenerate(spec)
        responses = [f"<answer>{task.answer}</answer>", "<answer>-99</answer>"]
        groups.append(Group(task=task, responses=responses, rewards=score_responses(task, responses)))
    accepted = verifier.verify(make_batch(peer, "s", 3, "m", groups))
    expected = [g for g in groups if not MIX.reserves(g.task)]
    assert accepted and len(accepted) == len(expected) < len(groups)
    assert not any(MIX.reserves(g.task) for g in accepted)
    assert stats.rejected[peer.public_key_hex]["task_not_allowed"] == len(groups) - len(expected)


def test_the_share_is_validated_and_a_mix_table_can_set_it():
    table = {"base": "cpu-learn", "datasets": {"chain_sum": MIX.datasets["chain_sum"]}, "unseen_share": 0.5}
    mix = resolve_mix(table)
    assert mix.unseen_share == 0.5 and mix.has_unseen() and mix.to_dict()["unseen_share"] == 0.5
    assert resolve_mix({**table, "unseen_share": 0}).has_unseen() is False
    with pytest.raises(TaskError, match="unseen_share"):
        resolve_mix({**table, "unseen_share": 1.0})
    validate_mix(MIX)
