"""A round that fails on an unexpected error (a bug, a failing disk, out of memory) must not leave a checkpoint
that resumes into a state no round ended in: while its weights have not moved the round is rewound and the last
completed round is checkpointed as usual; once an optimizer step has started they cannot be rewound, so nothing
is checkpointed and --resume goes on from the last checkpoint."""

import pytest

from conftest import tiny_memory_node
from node import loop as round_loop
from node.ops.checkpoint import CheckpointStore


def failing_on_second_call(target):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk gone")
        return target(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("where", ["before the update", "in the update, before its first step", "after the update"])
async def test_a_failed_round_checkpoints_only_a_state_a_round_ended_in(tmp_path, monkeypatch, where):
    real_local_group = round_loop.local_group

    def with_signal(*args):  # a random model earns nothing: every group gets a signal, so every round trains
        group = real_local_group(*args)
        group.rewards = [1.0, 0.0]
        return group

    monkeypatch.setattr(round_loop, "local_group", with_signal)
    node = tiny_memory_node(tmp_path, "--rounds", "3", "--checkpoint-every", "100", "--eval-every", "0")
    sampler_states = []
    sample = node.sampler.sample
    node.sampler.sample = lambda n: sampler_states.append(node.sampler.state_dict()) or sample(n)
    if where == "before the update":
        monkeypatch.setattr(round_loop, "select_groups", failing_on_second_call(round_loop.select_groups))
    elif where == "in the update, before its first step":  # e.g. out of memory in the forward pass
        node.trainer._accumulate = failing_on_second_call(node.trainer._accumulate)
    else:
        node.totals.add = failing_on_second_call(node.totals.add)
    with pytest.raises(OSError, match="disk gone"):
        await node.run()
    assert node.trainer.steps_taken == (1 if where != "after the update" else 2)  # round 0 trained
    ckpt = CheckpointStore(tmp_path).load_latest()
    if where == "after the update":
        assert ckpt is None  # round 1's update is in memory, round 0's weights are not: nothing true to save
    else:
        assert ckpt.round == 0 and ckpt.state["next_round"] == 1
        assert ckpt.state["sampler"] == sampler_states[1]  # rewound: round 1 samples its tasks again on resume
