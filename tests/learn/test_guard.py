"""The collapse guard's decisions (node/learn/guard.py) on hand-made evaluations."""

import torch

from conftest import tiny_memory_node
from node.learn.guard import START_ROUND, CollapseGuard, EvalSummary, GuardConfig, collapsed


def ev(r, acc, distinct=0.4, baseline=0.12, gold=0.35):
    return EvalSummary(round=r, accuracy=acc, baseline=baseline, distinct=distinct, distinct_gold=gold)


def test_definition_of_collapse():
    assert collapsed(ev(0, 0.16))  # within 0.05 of the constant answer
    assert collapsed(ev(0, 0.60, distinct=0.10))  # answers do not vary with the question
    assert not collapsed(ev(0, 0.60, distinct=0.30))


def test_best_evaluation_is_the_restore_point_and_a_collapse_from_it_restores():
    g = CollapseGuard()
    # the base model: collapsed, but nothing to fall from
    assert g.judge(ev(0, 0.15, distinct=0.13)).action == "snapshot"
    assert g.judge(ev(10, 0.40)).action == "snapshot"
    assert g.judge(ev(20, 0.35)).action == "keep"  # worse, but still answering
    v = g.judge(ev(30, 0.11, distinct=0.05))
    assert (v.action, v.restored_to, v.lr_scale) == ("restore", 10, 0.5)
    assert "constant answer" in v.reason
    assert g.judge(ev(40, 0.10, distinct=0.05)).lr_scale == 0.25  # each restore lowers the rate again
    assert g.state.restores == 2 and [h["restored_to"] for h in g.state.history] == [10, 10]


def test_the_reason_names_the_sign_of_collapse_that_was_seen():
    # 8b shares seed 0, a Gemma peer: 0.411 at round 10, then 0.242 (0.105 above the constant answer's 0.137)
    # with its greedy answers down to 0.133 distinct against the gold answers' 0.344
    g = CollapseGuard()
    g.judge(ev(10, 0.411, distinct=0.578, baseline=0.137, gold=0.344))
    v = g.judge(ev(20, 0.242, distinct=0.133, baseline=0.137, gold=0.344))
    assert v.action == "restore" and "constant answer" not in v.reason
    assert "distinct greedy answers 0.133" in v.reason and "0.169 below round 10's" in v.reason
    g = CollapseGuard()
    g.judge(ev(10, 0.40))
    assert "within 0.05 of the constant answer" in g.judge(ev(20, 0.16)).reason


def test_collapse_straight_from_the_base_model_is_caught_by_its_answers():
    g = CollapseGuard()
    g.judge(ev(0, 0.15, distinct=0.13))
    assert g.judge(ev(10, 0.12, distinct=0.10)).action == "keep"  # as varied as the base model: not a collapse
    v = g.judge(ev(20, 0.12, distinct=0.03))
    assert v.action == "restore" and v.restored_to == 0 and "distinct" in v.reason


def test_babbling_below_the_constant_answer_is_caught_from_a_weak_best():
    # RESULTS 7, lr 1e-4 seed 100, peer kept by the first guard: best 0.175 at round 0 (itself within the
    # margin), then 0.104 with nearly every greedy answer different, under the constant answer's 0.137
    g = CollapseGuard()
    g.judge(ev(0, 0.175, distinct=0.14, baseline=0.137, gold=0.3))
    v = g.judge(ev(29, 0.104, distinct=0.84, baseline=0.137, gold=0.3))
    assert v.action == "restore" and v.restored_to == 0 and "below the constant answer" in v.reason
    # the same fall that stays above the constant answer is the margin's business, not this rule's
    g = CollapseGuard()
    g.judge(ev(0, 0.175, distinct=0.14, baseline=0.137, gold=0.3))
    assert g.judge(ev(29, 0.14, distinct=0.84, baseline=0.137, gold=0.3)).action == "keep"
    # below the constant answer but barely below the best: noise, not a collapse from it
    g = CollapseGuard()
    g.judge(ev(0, 0.13, distinct=0.14, baseline=0.137, gold=0.3))
    assert g.judge(ev(29, 0.10, distinct=0.84, baseline=0.137, gold=0.3)).action == "keep"


def test_a_collapse_is_never_the_restore_point_even_when_its_accuracy_is_higher():
    g = CollapseGuard()
    g.judge(ev(0, 0.0, distinct=0.5, baseline=0.25, gold=0.9))  # the base answers varied, all wrong
    v = g.judge(ev(2, 0.008, distinct=0.125, baseline=0.25, gold=0.9))  # one answer to everything, one right
    assert v.action == "restore" and v.restored_to == 0 and g.best.round == 0


def test_rate_has_a_floor_and_the_guard_can_be_off():
    g = CollapseGuard(GuardConfig(lr_factor=0.1, min_lr_scale=0.01))
    g.judge(ev(0, 0.5))
    for r in range(1, 5):
        v = g.judge(ev(r, 0.1, distinct=0.02))
    assert v.lr_scale == 0.01
    off = CollapseGuard(GuardConfig(enabled=False))
    off.judge(ev(0, 0.5))
    assert off.judge(ev(1, 0.1, distinct=0.02)).action == "keep"


def test_state_round_trips():
    g = CollapseGuard()
    g.judge(ev(0, 0.5))
    g.judge(ev(1, 0.1, distinct=0.02))
    h = CollapseGuard()
    h.load_state_dict(g.state_dict())
    assert h.state == g.state and h.best == g.best


def test_summary_from_a_metrics_record():
    rec = {"eval_accuracy": 0.3, "eval_baseline": 0.12, "eval_distinct_answers": 0.3, "eval_distinct_gold": 0.35}
    assert EvalSummary.from_record(7, rec) == EvalSummary(7, 0.3, 0.12, 0.3, 0.35)
    assert EvalSummary.from_record(7, {"reward_mean": 0.2}) is None


def test_a_failed_restore_forgets_the_best_and_keeps_the_lower_rate():
    g = CollapseGuard()
    g.judge(ev(0, 0.40))
    g.judge(ev(10, 0.11, distinct=0.05))  # restore (its restore point will turn out unreadable)
    g.restore_failed()
    assert g.state.restores == 0 and g.state.best is None and g.state.lr_scale == 0.5
    assert g.state.history[-1]["failed"]
    assert g.judge(ev(20, 0.11, distinct=0.05)).action == "keep"  # still collapsed: not a restore point
    assert g.judge(ev(30, 0.30)).action == "snapshot"  # the first evaluation that is not a collapse is


async def test_a_node_whose_restore_point_is_gone_trains_on(tmp_path):
    """The guard calls for a restore, but the restore point was deleted: the node says so and goes on at
    the lower rate instead of dying on its own missing file."""
    node = tiny_memory_node(tmp_path, "--lr", "1e-3")
    try:
        node.guard.judge(ev(0, 0.40))  # a best whose restore point was never written (or was deleted since)
        record = {
            "eval_accuracy": 0.11,
            "eval_baseline": 0.12,
            "eval_distinct_answers": 0.05,
            "eval_distinct_gold": 0.35,
        }
        await node.evaluation.judge(10, record)
        assert record["guard_action"] == "restore_failed" and "no restore point" in record["guard_reason"]
        assert node.trainer.lr == 1e-3 * 0.5 and node.guard.state.best is None
    finally:
        node.worker.shutdown()


async def test_a_restore_point_of_another_round_is_not_loaded(tmp_path):
    """A restore point left by a timeline the run went back from (kill -9 after it, resume from an older
    checkpoint) is not the guard's best: loading it would put back weights the log does not name."""
    node = tiny_memory_node(tmp_path, "--lr", "1e-3")
    try:
        node.persistence.save_restore_point(30)
        node.guard.judge(ev(20, 0.40))  # the resumed run's best: round 20
        record = {
            "eval_accuracy": 0.11,
            "eval_baseline": 0.12,
            "eval_distinct_answers": 0.05,
            "eval_distinct_gold": 0.35,
        }
        await node.evaluation.judge(40, record)
        assert record["guard_action"] == "restore_failed" and "not of round 20" in record["guard_reason"]
    finally:
        node.worker.shutdown()


def test_a_collapse_in_round_0s_own_update_goes_back_to_the_start():
    """The starting weights' evaluation (START_ROUND) is the first restore point, collapsed by the definition
    or not (a base model can be); a round 0 that fell from it is restored to it."""
    g = CollapseGuard()
    assert g.judge(ev(START_ROUND, 0.06, distinct=0.56, baseline=0.25, gold=0.6)).action == "snapshot"
    v = g.judge(ev(0, 0.0, distinct=0.125, baseline=0.25, gold=0.6))  # the H100's round 0 at lr 5e-2
    assert (v.action, v.restored_to) == ("restore", START_ROUND) and "below the start's" in v.reason


async def test_the_node_evaluates_its_starting_weights_and_can_go_back_to_them(tmp_path):
    node = tiny_memory_node(tmp_path, "--lr", "1e-3", "--eval-every", "1", "--eval-size", "4")
    try:
        await node.evaluation.start()
        assert node.guard.best.round == START_ROUND and (tmp_path / "restore-point" / "round-start").is_dir()
        assert {"start_accuracy", "start_baseline", "start_scores", "start_s"} <= set(node.evaluation.start_eval)
        start = {k: v.clone() for k, v in node.model.state_dict().items()}
        node.guard.state.best["accuracy"] = 0.40  # as if the start had answered well
        with torch.no_grad():
            for p in node.model.parameters():
                if p.requires_grad:  # the adapter (or the whole model without LoRA)
                    p.add_(0.5)  # round 0's update, a ruinous one
        record = {
            "eval_accuracy": 0.0,
            "eval_baseline": 0.12,
            "eval_distinct_answers": 0.05,
            "eval_distinct_gold": 0.35,
        }
        await node.evaluation.judge(0, record)
        assert record["guard_action"] == "restore" and record["guard_restored_to"] == START_ROUND
        assert [k for k, v in node.model.state_dict().items() if not torch.equal(v, start[k])] == []
    finally:
        node.worker.shutdown()
