"""The answer rule of a dataset config (node/learn/tasks.py): `result` reads an equation answer by its result;
reasoning-gym never sees the key; a mix with an unknown rule is refused; peers whose rules differ do not take
each other's tasks (RESULTS 7a)."""

import pytest

from node.learn.tasks import TaskError, TaskSpec, eval_tasks, read_answer, resolve_mix, score


def test_result_rule_reads_an_equation_by_its_result_and_exact_keeps_it_whole():
    assert read_answer("4 + 9 = 13", "result") == "13" and read_answer("13", "result") == "13"
    assert read_answer("4 + 9 = 13", "exact") == "4 + 9 = 13"
    task = eval_tasks(resolve_mix("cpu-learn"), 1)[0]
    assert dict(task.spec.config)["answer_rule"] == "result"
    assert score(task, f"1 + 1 = {task.answer}") == 1.0  # the result is right: full reward
    assert score(task, "1 + 1 = none") == 0.0 and score(task, task.answer) == 1.0
    # the same task under the exact rule: reasoning-gym's partial credit for containing the answer
    exact = dict(task.spec.config, answer_rule="exact")
    from node.learn.tasks import regenerate

    same = regenerate(TaskSpec.make(task.spec.dataset, exact, task.spec.seed, task.spec.index))
    assert same.question == task.question and same.answer == task.answer  # reasoning-gym never saw the key
    assert 0 < score(same, f"1 + 1 = {task.answer}") < 1


def test_unknown_rule_is_refused_and_a_mix_without_the_rule_does_not_take_v3_tasks():
    with pytest.raises(TaskError, match="answer_rule"):
        resolve_mix({"base": "cpu-learn", "datasets": {"chain_sum": {"config": {"answer_rule": "lenient"}}}})
    v3 = resolve_mix("cpu-learn")
    spec = eval_tasks(v3, 1)[0].spec
    v2_config = {k: v for k, v in spec.config_dict().items() if k != "answer_rule"}
    v2 = resolve_mix({"base": "cpu-learn", "datasets": {spec.dataset: {"config": v2_config}}})
    train_spec = TaskSpec.make(spec.dataset, spec.config_dict(), 7, 3)
    assert v3.allows(train_spec) and not v2.allows(train_spec)
