"""A node does not evaluate weights that have not moved since their last evaluation (node/evaluation.py)."""

from dataclasses import replace

from conftest import tiny_memory_node
from node.learn.evaluate import EvalResult
from node.learn.guard import START_ROUND
from node.learn.tasks import PRESETS
from node.ops.live import PhaseTimer


def counting(node):
    """Wrap the node's held-out run so the test sees which evaluations really ran, and with the unseen set."""
    calls = []
    run = node.evaluation.held_out_run

    async def counted(unseen):
        calls.append(unseen)
        return await run(unseen)

    node.evaluation.held_out_run = counted
    return calls


async def after(node, r):
    record = {"round": r, "phase_s": {}}
    await node.evaluation.after_round(r, PhaseTimer(node.live), record, False)
    return record


async def test_unchanged_weights_repeat_the_last_evaluation_and_a_step_or_restore_evaluates_again(tmp_path):
    node = tiny_memory_node(tmp_path, "--eval-every", "1", "--eval-size", "4")
    try:
        calls = counting(node)
        await node.evaluation.start()
        start = node.evaluation.start_eval
        first = await after(node, 0)  # round 0 took no optimizer step: the start's answers again
        assert calls == [True]
        assert first["eval_repeats"] == START_ROUND and first["eval_s"] == 0.0
        assert first["eval_accuracy"] == start["start_accuracy"] and first["eval_scores"] == start["start_scores"]
        assert first["eval_answers"] == start["start_answers"]

        node.trainer.steps_taken += 1  # as an update does: the weights moved
        second = await after(node, 1)
        assert len(calls) == 2 and "eval_repeats" not in second and second["eval_s"] > 0
        assert (await after(node, 2))["eval_repeats"] == 1  # still round 1's weights

        node.guard.state.best["accuracy"] = 0.9  # a collapse from a good restore point: the guard restores
        collapsed = {"eval_accuracy": 0.0, "eval_baseline": 0.12, "eval_distinct_answers": 0.05}
        assert await node.evaluation.judge(3, {**collapsed, "eval_distinct_gold": 0.35})
        node.guard.state.best["accuracy"] = 0.0  # no second restore: the next rounds keep these weights
        third = await after(node, 3)  # other weights are in place: evaluated again
        assert "eval_repeats" not in third and len(calls) == 3 and third["phase_s"]["eval"] > 0
        assert (await after(node, 4))["phase_s"]["eval"] == 0.0 and len(calls) == 3
    finally:
        node.worker.shutdown()


async def test_a_repeat_needs_the_unseen_set_when_the_round_is_due_one(tmp_path):
    """An evaluation without the unseen set cannot stand in for one that needs it; one with it serves both. (A
    fake held-out run: the in-memory node's mix has no content split.)"""
    node = tiny_memory_node(tmp_path)
    calls = []

    async def fake(unseen):
        calls.append(unseen)
        held = EvalResult(accuracy=0.25, scores=[0.0, 1.0, 0.0, 0.0], seconds=3.0)
        return replace(held, unseen=EvalResult(accuracy=0.5, scores=[1.0, 0.0]) if unseen else None)

    node.evaluation.held_out_run = fake
    node.evaluation.held_out.mix = PRESETS["cpu-learn"]  # a mix with a content split
    try:
        assert PRESETS["cpu-learn"].has_unseen() and not PRESETS["smoke"].has_unseen()
        result, repeats = await node.evaluation._measure(0, False)
        assert (repeats, calls, result.unseen) == (None, [False], None)
        result, repeats = await node.evaluation._measure(1, True)
        assert (repeats, calls) == (None, [False, True]) and result.unseen is not None
        both, repeats = await node.evaluation._measure(2, True)
        assert (repeats, calls, both.unseen) == (1, [False, True], result.unseen)
        again, repeats = await node.evaluation._measure(3, False)
        assert (repeats, calls, again.unseen) == (1, [False, True], None)
        assert again.scores == result.scores and again.seconds == 0.0 and result.seconds == 3.0

        node.evaluation.held_out.mix = PRESETS["smoke"]  # no split: a result without the unseen set serves all
        node.trainer.steps_taken += 1
        assert (await node.evaluation._measure(4, False))[1] is None and calls[-1] is False
        assert (await node.evaluation._measure(5, True))[1] == 4 and len(calls) == 3
    finally:
        node.worker.shutdown()
