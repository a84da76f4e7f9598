"""select_groups: zero-advantage groups are dropped, at most I local groups are kept (in order), and J
external groups are drawn uniformly (seeded) from those that carry a learning signal."""

import random
from collections import Counter

import pytest

from node.learn.groups import Group, select_groups
from node.learn.tasks import PRESETS, TaskSampler

TASKS = TaskSampler(PRESETS["smoke"], 5).sample(4)


def group(i: int, rewards: list[float], source: str = "local") -> Group:
    return Group(TASKS[i % len(TASKS)], [f"<answer>{k}</answer>" for k in range(len(rewards))], rewards, source=source)


def test_zero_advantage_groups_are_dropped_and_at_most_i_local_kept_in_order():
    local = [
        group(0, [1.0, 1.0, 1.0]),
        group(1, [1.0, 0.0, 0.0]),
        group(2, [0.0, 0.0, 0.0]),
        group(3, [0.2, 0.5, 0.5]),
        group(4, [0.3, 0.3, 0.3]),
        group(5, [0.0, 1.0, 1.0]),
    ]
    external = [group(i, r, source=f"{i:064x}") for i, r in enumerate([[0.5, 0.5], [0.0, 1.0], [1.0, 1.0], [0.7, 0.1]])]
    sel = select_groups(local, external, num_local=2, num_external=8, rng=random.Random(0))
    assert sel.local == [local[1], local[3]]  # the first two with signal, in sampling order
    assert (sel.dropped_local, sel.dropped_external, sel.external_available) == (3, 2, 2)
    assert sorted(sel.external, key=external.index) == [external[1], external[3]]  # J > available: all of them
    every = select_groups(local, [], num_local=10, num_external=2, rng=random.Random(0))
    assert every.local == [local[1], local[3], local[5]] and every.external == []
    none = select_groups(local, external, num_local=0, num_external=0, rng=random.Random(0))
    assert none.local == [] == none.external and none.dropped_local == 3  # counted even when I = 0


def test_j_external_groups_are_a_uniform_sample_without_replacement():
    """8 useful external groups, J = 3, 8000 seeded draws: each group is chosen 3/8 of the time (a chi-square
    test at p = 0.001 with 7 degrees of freedom), never twice in one draw, and every one of the 56
    possible sets occurs. Taking the first J, or favouring a publisher, fails it."""
    external = [group(i, [float(i % 2), 1.0 - float(i % 2), 0.5], source=f"{i:064x}") for i in range(8)]
    external += [group(i, [0.4, 0.4, 0.4], source=f"{100 + i:064x}") for i in range(4)]  # no signal
    rng = random.Random(1234)
    counts, sets, n = Counter(), Counter(), 8000
    for _ in range(n):
        sel = select_groups([], external, num_local=4, num_external=3, rng=rng)
        ids = [external.index(g) for g in sel.external]
        assert len(ids) == 3 == len(set(ids)) and max(ids) < 8
        counts.update(ids)
        sets[frozenset(ids)] += 1
    expected = n * 3 / 8
    chi2 = sum((counts[i] - expected) ** 2 / expected for i in range(8))
    assert chi2 < 24.32, (chi2, counts)  # 99.9th percentile of chi-square(7)
    assert len(sets) == 56
    # seeded: the same seed draws the same groups
    again = [select_groups([], external, 4, 3, random.Random(7)).external for _ in range(2)]
    assert again[0] == again[1]


@pytest.mark.parametrize("num_local, num_external", [(4, 0), (1, 3), (0, 4)])
def test_counts_never_exceed_the_targets(num_local, num_external):
    rng = random.Random(3)
    for _ in range(50):
        local = [group(i, [rng.choice([0.0, 1.0]) for _ in range(4)]) for i in range(rng.randint(0, 6))]
        external = [
            group(i, [rng.choice([0.0, 1.0]) for _ in range(4)], source=f"{i:064x}") for i in range(rng.randint(0, 9))
        ]
        sel = select_groups(local, external, num_local, num_external, rng)
        assert len(sel.local) <= num_local and len(sel.external) <= num_external
        assert all(g.signal() for g in sel.local + sel.external)
        assert len(sel.local) == min(num_local, len(local) - sel.dropped_local)
        assert len(sel.external) == min(num_external, sel.external_available)


def test_a_group_with_signal_in_the_surveys_sense_holds_a_right_and_a_wrong_answer():
    from node.learn.groups import right_and_wrong

    assert right_and_wrong([1.0, 0.0, 0.0]) and right_and_wrong([1.0, 0.5])
    assert not right_and_wrong([1.0, 1.0]) and not right_and_wrong([0.5, 0.0]) and not right_and_wrong([])
