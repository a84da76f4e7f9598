"""No answer a peer sends is run as code by a scorer (node/learn/answer_guard.py), and the guard keeps every
right answer right."""

from __future__ import annotations

import pytest

from node.learn import answer_guard, gym
from node.learn.tasks import TaskSpec, regenerate, score

# datasets whose default config does not build here: composite names no datasets, word_ladder's default size is
# too large for its word list; acre's builds for minutes
NOT_BUILT = {"composite", "word_ladder", "acre"}


def hostile_answers(marker) -> list[str]:
    """Answers that run code if a scorer evaluates them: as they are, inside a list, and a bare exit."""
    touch = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return [touch, f"[{touch}]", f"({touch},)", "exit(3)", "[1] * 10 ** 2"]


def test_no_scorer_runs_an_answer(tmp_path):
    """Every reasoning-gym dataset's scorer, through the node's `score`: nothing runs, nothing escapes, and the
    score stays in [0, 1]. (Without the guard binary_matrix, spiral_matrix, string_insertion and n_queens run
    the first answers through eval, the sympy ones through parse_expr; exit(3) escaped as SystemExit.)"""
    marker = tmp_path / "ran"
    ran, checked = [], 0
    for name in sorted(set(gym.datasets()) - NOT_BUILT):
        task = regenerate(TaskSpec.make(name, {}, 0, 0))
        for answer in hostile_answers(marker):
            assert 0.0 <= score(task, answer) <= 1.0
            if marker.exists():
                ran.append(name)
                marker.unlink()
        checked += 1
    assert checked >= 100
    assert ran == []


@pytest.mark.parametrize(
    "name",
    sorted(answer_guard.ARITHMETIC_DATASETS | answer_guard.ALGEBRA_DATASETS)
    + ["binary_matrix", "spiral_matrix", "string_insertion", "n_queens"],
)
def test_right_answers_stay_right(name):
    """The guarded datasets' own answers (20 tasks each) score what reasoning-gym's scorer gives them."""
    for index in range(20):
        task = regenerate(TaskSpec.make(name, {}, 7, index))
        expected = gym.create_dataset(name, seed=7, size=20).score_answer(task.answer, task.entry)
        assert expected > 0
        assert score(task, task.answer) == pytest.approx(min(1.0, expected))


def test_a_list_answer_still_gets_the_scorers_partial_credit():
    """literal_eval gives what eval gave for a literal: binary_matrix's 0.1 for the matrix as a Python list."""
    task = regenerate(TaskSpec.make("binary_matrix", {}, 0, 0))
    rows = [[int(v) for v in line.split()] for line in task.answer.splitlines()]
    assert score(task, str(rows)) == pytest.approx(0.1)
    assert score(task, f"[{str(rows)[1:-1]}] ") == pytest.approx(0.1)


@pytest.mark.parametrize(
    "dataset, answer, admitted",
    [
        ("countdown", "(3 + 5) * 2 - 1", True),
        ("countdown", "open(chr(47))", False),  # a name: arithmetic has none
        ("countdown", "2 ** 3", False),  # no powers in arithmetic
        ("countdown", "1e9", False),  # plain decimals only
        ("countdown", "3!", False),  # sympy's factorial notation
        ("countdown", "(1", False),
        ("polynomial_multiplication", "-3*X**4 + 12*X**3 - x", True),
        ("polynomial_multiplication", "(x + 1)**64", True),
        ("polynomial_multiplication", "((x + 1)**8)**8", True),
        ("polynomial_multiplication", "((x + 1)**64)**2", False),  # nested powers multiply past 64
        ("polynomial_multiplication", "x**2**3", False),  # a tower
        ("polynomial_multiplication", "x**(65)", False),
        ("polynomial_multiplication", "x**(3/2) + x**-2 + x**y", True),
        ("simple_integration", "exp(x)*sin(x) + sqrt(x) + C", True),
        ("simple_integration", "N(pi, 99999)", False),  # sympy callables under one letter are refused
        ("simple_integration", "exec(bytes((1, 2)))", False),
        ("simple_integration", "x.func", False),
        ("simple_integration", "lambda x: x", False),
        ("simple_integration", "'x'", False),
        ("basic_arithmetic", "1" * (answer_guard.MAX_ANSWER_CHARS + 1), False),  # every dataset: the length cap
        ("basic_arithmetic", "anything at all", True),
    ],
)
def test_admits(dataset, answer, admitted):
    assert answer_guard.admits(dataset, answer) is admitted


def test_literal_eval_is_evals_value_for_literals_only():
    assert answer_guard.literal_eval(" [[1, 0], [0, 1]]") == [[1, 0], [0, 1]]
    for code in ("exit(3)", "[1] * 3", "f'{1}'", "x"):
        with pytest.raises((ValueError, SyntaxError)):
            answer_guard.literal_eval(code)


def test_a_composite_task_is_guarded_as_its_source_dataset():
    entry = {"metadata": {"source_dataset": "countdown"}}
    assert answer_guard.scorer_dataset("composite", entry) == "countdown"
    assert answer_guard.scorer_dataset("countdown", {"metadata": {"source_dataset": "x"}}) == "countdown"
    assert answer_guard.scorer_dataset("composite", {"metadata": None}) == "composite"


def test_out_of_memory_is_no_score_where_the_sandbox_asks(monkeypatch):
    """In-process a scorer out of memory scores 0 as before; the scoring sandbox (memory capped) asks for the
    MemoryError instead, so that the group is unscored rather than a mismatch charged to its publisher."""
    from node.learn import tasks

    class Greedy:
        def score_answer(self, answer, entry):
            raise MemoryError

    task = regenerate(TaskSpec.make("basic_arithmetic", {}, 0, 0))
    monkeypatch.setattr(tasks, "_dataset", lambda *_: Greedy())
    assert score(task, "12") == 0.0
    with pytest.raises(MemoryError):
        score(task, "12", memory_errors=True)
