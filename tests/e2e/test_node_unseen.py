"""End to end: a `sapo-node` run of a mix split by content records its unseen evaluation everywhere a
newcomer looks (metrics.jsonl, the log, TensorBoard, the progress view)."""

import pytest

from conftest import run_node
from node.learn.tasks import PRESETS, eval_tasks
from node.ops.metrics import read_records
from node.ops.progress import main as progress_main
from tbread import read_scalars


@pytest.mark.slow
def test_a_cpu_learn_run_records_its_unseen_evaluation(tmp_path, capsys):
    run_dir = tmp_path / "run"
    done = run_node(
        "--model",
        "tiny-random",
        "--tasks",
        "cpu-learn",
        "--generations",
        "2",
        "--num-local",
        "2",
        "--max-new-tokens",
        "4",
        "--seed",
        "3",
        "--rounds",
        "2",
        "--eval-every",
        "1",
        "--eval-size",
        "4",
        "--eval-unseen-size",
        "6",
        "--run-dir",
        str(run_dir),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read_records(run_dir / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1]
    unseen = eval_tasks(PRESETS["cpu-learn"], 6, unseen=True)
    for r in rows:
        assert r["eval_size"] == 4 and r["eval_unseen_size"] == 6
        assert 0 <= r["eval_unseen_accuracy"] <= 1 and 0 < r["eval_unseen_baseline"] < 1
        assert {"eval_unseen_accuracy/basic_arithmetic", "eval_unseen_accuracy/chain_sum"} <= set(r)
        assert r["eval_unseen_datasets"] == [t.spec.dataset for t in unseen] and len(r["eval_unseen_scores"]) == 6
    assert rows[0]["start_unseen_size"] == 6 and 0 <= rows[0]["start_unseen_accuracy"] <= 1  # before training
    assert (run_dir / "node.log").read_text().count("unseen accuracy") == 3  # the starting weights', rounds 0, 1
    tags = read_scalars(run_dir / "tb")
    assert [step for step, _ in tags["eval/unseen_accuracy"]] == [0, 1]
    assert progress_main([str(run_dir), "--once"]) == 0
    table = capsys.readouterr().out
    assert "unseen (const)" in table and f"(const {rows[-1]['eval_unseen_baseline']:.3f}) @1" in table
