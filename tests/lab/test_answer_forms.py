"""scripts/research/answer_forms.py: equation answers are found, and read as their result with the node's own scorer."""

from node.learn.tasks import eval_tasks, resolve_mix, score
from scripts.research import answer_forms


def test_equations_read_as_their_result():
    assert answer_forms.result_of("3 - 2 = 1") == "1" and answer_forms.result_of("7") is None
    v3 = resolve_mix("cpu-learn")  # v2 scored answers whole: the cells this script was written for
    v2 = resolve_mix(
        {
            "base": "cpu-learn",
            "datasets": {
                name: {"config": dict(entry["config"], answer_rule="exact")} for name, entry in v3.datasets.items()
            },
        }
    )
    tasks = eval_tasks(v2, 4)
    golds = [t.answer for t in tasks]
    answers = [f"x = {golds[0]}", "x = none", golds[2], "none"]
    # as the node scores them: the plain right answer 1, the equation with the right result only partly
    node = [score(t, a) for t, a in zip(tasks, answers)]
    assert node[2] == 1.0 and 0 < node[0] < 1 and node[1] == node[3] == 0
    f = answer_forms.forms(answers, tasks)
    assert f["equation_share"] == 0.5 and f["equation_result_right"] == 0.5
    assert f["read_as_result"] == 0.5  # the right equation now scores 1, the wrong one still 0
