"""The collapse guard on a real model: an absurd learning rate collapses the embedded default model's answers
onto one string; the guard notices at the next evaluation, puts back the best evaluation's weights and lowers
the rate, and the node answers like itself again. Switched off, the collapse stays (checked by hand; see the
closing note of the recipe work), so this test fails without the guard.

The guard's first reference is the starting weights' evaluation, before round 0's update: at this rate round 0's
own update can already collapse the model (it did on an H100, whose sampling draws other completions; BENCHMARKS
"The suite on a GPU"), and a reference taken after it would leave nothing to go back to."""

import pytest

from conftest import run_node
from node.learn.guard import START_ROUND, EvalSummary, collapsed
from node.ops.metrics import read_records

pytestmark = pytest.mark.timeout(600)

ARGS = [
    "--model",
    "default",
    "--tasks",
    "cpu-learn",
    "--lora-rank",
    "8",
    "--generations",
    "4",
    "--num-local",
    "2",
    "--num-external",
    "0",
    "--max-new-tokens",
    "8",
    "--seed",
    "2",
    "--lr",
    "5e-2",
    "--guard-lr-factor",
    "0.1",
    "--eval-every",
    "1",
    "--eval-size",
    "16",
    "--eval-unseen-size",
    "8",
    "--rounds",
    "4",
    "--rollout-engine",
    "torch",
    "--no-tensorboard",
]


@pytest.mark.slow
def test_guard_catches_a_forced_collapse_and_recovers(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_node(*ARGS, "--run-dir", str(run_dir), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(run_dir / "metrics.jsonl")
    evals = {r["round"]: EvalSummary.from_record(r["round"], r) for r in records}
    evals[START_ROUND] = EvalSummary.from_record(START_ROUND, records[0], prefix="start")
    assert evals[START_ROUND] is not None and "of the starting weights, before round 0" in proc.stderr
    restores = [r for r in records if r.get("guard_action") == "restore"]
    assert restores, [(r["round"], r.get("guard_action"), r["eval_distinct_answers"]) for r in records]
    first = restores[0]
    best = evals[first["guard_restored_to"]]
    assert collapsed(evals[first["round"]]) and evals[first["round"]].distinct < 0.5 * best.distinct  # a real collapse
    assert first["lr"] == pytest.approx(5e-2 * 0.1) and first["guard_restores"] == 1
    assert "collapse guard" in proc.stderr
    after = [evals[r["round"]] for r in records if r["round"] > first["round"]]
    assert after and all(e.distinct >= 0.5 * best.distinct for e in after)  # answers vary with the question again
    assert (run_dir / "restore-point").is_dir()
