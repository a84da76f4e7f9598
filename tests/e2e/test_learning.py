"""The node learns: on the embedded default model (SmolLM2-135M, GGUF), a silo `sapo-node` process and a
two-peer swarm that trains on each other's groups both answer the held-out set far above round 0 and above
the constant-answer baseline within five rounds, and their training reward rises.

The task mix is `test-learn` (node/learn/tasks.py): the model can repeat a one-digit number, but the
system prompt's example teaches it an answer format the reward scores 1/15. That is a reward the model
can learn in a few rounds with LoRA at a high rate, and only by learning from it: a node whose update
pushes the wrong way (advantages negated where groups become training sequences) stays below the
baseline and fails both tests. Measured for the silo (lr 5e-4, seeds 0-2): held-out accuracy 0.05-0.31
after round 0 and 1.0 after round 4; training reward 0.03-0.06 in round 0, 0.58-1.0 in round 4 (the two
peers: their test's docstring).

What "learned" means: the held-out accuracy, greedy and after the last update, is the measure. The
training reward is a noisy witness: 16 completions sampled at temperature by a policy one update behind
(a round samples before it trains), and in a swarm of two the groups a peer gets depend on timing. So it
must only rise clearly; requiring it above the baseline too failed a correct run (CI, seed 0: held-out
0.047 -> 0.944 while round 4's reward was 0.376).
"""

from __future__ import annotations

import pytest

from conftest import live_metrics, prefix_of, run_node, run_python, sources
from helpers_learning import check_records

ROUNDS = 5
LEARN = [
    "--model",
    "default",
    "--tasks",
    "test-learn",
    "--lora-rank",
    "8",
    "--lr",
    "5e-4",
    "--generations",
    "8",
    "--rounds",
    str(ROUNDS),
    "--eval-every",
    str(ROUNDS - 1),
    "--eval-size",
    "16",
]
NODE_ONLY = ["--mixed-precision", "off", "--rollout-engine", "torch", "--no-tensorboard", "--checkpoint-every", "100"]
MARGIN = 0.3  # what "learned" means: far above both yardsticks, ~5 of the 16 held-out tasks, not a lucky one
REWARD_RISE = 0.15  # the training reward's rise from round 0 to the last round (measured: +0.26 or more)

pytestmark = pytest.mark.timeout(600)


def assert_learned(records: list[dict], who: str) -> None:
    """Held-out accuracy after the last round far above round 0's and above the constant-answer baseline;
    the training reward of the last round clearly above round 0's (the module's docstring says why no more)."""
    assert [r["round"] for r in records] == list(range(ROUNDS)), who
    check_records(records)
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["round"] for r in evals] == [0, ROUNDS - 1], who
    first, last = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    baseline = evals[-1]["eval_baseline"]
    curve = [round(r["reward_mean"], 3) for r in records]
    summary = f"{who}: held-out {first:.3f} -> {last:.3f} (baseline {baseline:.3f}); reward by round {curve}"
    print(summary)
    assert 0.1 < baseline < 0.3, summary
    assert last >= first + MARGIN and last >= baseline + MARGIN, summary
    assert curve[-1] >= curve[0] + REWARD_RISE, summary


@pytest.mark.slow
def test_a_silo_node_learns_its_reward_and_the_held_out_set(tmp_path):
    """A real `sapo-node` process that loads the embedded GGUF model, samples its groups and learns."""
    run_dir = tmp_path / "silo"
    done = run_node(
        *LEARN, *NODE_ONLY, "--num-local", "4", "--num-external", "0", "--run-dir", str(run_dir), timeout=540
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loading model default" in done.stderr and "sampling with torch" in done.stderr
    records = live_metrics(run_dir)
    assert all(r["tokens_generated"] > 0 and r["num_external"] == 0 for r in records)
    assert_learned(records, "silo")


@pytest.mark.slow
def test_two_peers_learn_from_each_others_groups(tmp_path):
    """Two peers (2 local + 2 external groups a round, the silo's 4 groups per update) on the in-process
    board of `sapo-experiment --mode memory`: one base model, an adapter each, signed batches verified and
    re-scored; each trains on the other's groups in most rounds and both learn. At lr 1e-3 (measured, seeds
    0-3, 8 peers): reward 0.006-0.049 in round 0, 0.30-0.95 in round 4 (a rise of +0.26 or more); held-out
    0.05-0.50 -> 0.94-1.0. (At 5e-4, 2 + 2 groups had only begun to rise by round 4; 4 + 4 learned but cost
    twice the time.)"""
    exp = tmp_path / "exp"
    done = run_python(
        [
            "-m",
            "node.lab.experiment",
            "2/2",
            "--peers",
            "2",
            "--mode",
            "memory",
            "--seeds",
            "0",
            "--threads",
            "1",
            "--out",
            str(exp),
            *LEARN,
            "--lr",
            "1e-3",
            *[f"--node-arg={a}" for a in NODE_ONLY],
        ],
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peers = [live_metrics(exp / "2-2" / "seed0" / f"peer{p}") for p in range(2)]
    for p, records in enumerate(peers):
        assert all(r["target_local"] == 2 and r["target_external"] == 2 for r in records)
        used = [r for r in records if r["num_external"] > 0]
        assert len(used) >= ROUNDS - 2, f"peer{p} trained on the other's groups in rounds {[r['round'] for r in used]}"
        assert all(len(r["external_sources"]) == 1 for r in used)
        assert not any(r["rejected_by_reason"] for r in records), [r["rejected_by_reason"] for r in records]
        assert_learned(records, f"peer{p}")
    keys = [prefix_of(exp / "2-2" / "seed0" / f"peer{p}") for p in range(2)]
    assert [sources(records) for records in peers] == [{keys[1]}, {keys[0]}]  # each trained on the other's
