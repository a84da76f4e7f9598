"""End to end: a real `sapo-node` writes RUN_DIR/tb/ equal to metrics.jsonl, and a resume from an older
checkpoint leaves each round's step exactly once (the redone round's new values, not the orphaned ones)."""

import shutil

import numpy as np
import pytest

from conftest import run_node
from node.ops.metrics import read_records
from node.ops.tensorboard import scalars
from tbread import read_scalars, read_scalars_with_tensorboard


@pytest.mark.slow
def test_event_files_match_metrics_across_a_resume(tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    args = [*tiny_args, "--checkpoint-every", "2", "--eval-every", "2", "--eval-size", "4", "--run-dir", str(run_dir)]
    first = run_node(*args, "--rounds", "3")
    assert first.returncode == 0, first.stderr[-2000:]
    assert [s for s, _ in read_scalars(run_dir / "tb")["reward/mean"]] == [0, 1, 2]
    # resume from round 1's checkpoint: round 2 is redone, its first line goes to metrics.orphaned.jsonl
    shutil.rmtree(run_dir / "checkpoints" / "round-000002")
    resumed = run_node(*args, "--rounds", "5", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (run_dir / "metrics.orphaned.jsonl").exists()

    records = read_records(run_dir / "metrics.jsonl")
    assert [r["round"] for r in records] == [0, 1, 2, 3, 4]
    got = read_scalars(run_dir / "tb")
    assert [s for s, _ in got["reward/mean"]] == [0, 1, 2, 3, 4]
    expected: dict[str, list] = {}
    for rec in records:
        for tag, value in scalars(rec).items():
            expected.setdefault(tag, []).append((rec["round"], float(np.float32(value))))
    assert got == expected
    for tag in (
        "train/loss",
        "train/kl",
        "train/clip_frac",
        "collapse/token_entropy",
        "collapse/signal_frac",
        "groups/external_used",
        "time/phase/generate",
        "memory/peak_mb",
        "eval/accuracy",
        "eval/constant_answer_baseline",
    ):
        assert tag in got, tag
    assert [s for s, _ in got["eval/accuracy"]] == [0, 2, 4]
    viewer = read_scalars_with_tensorboard(run_dir / "tb")  # None unless the `tensorboard` package is installed
    assert viewer is None or viewer == expected


@pytest.mark.slow
def test_no_tensorboard_writes_no_event_file(tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    done = run_node(*tiny_args, "--rounds", "1", "--eval-every", "0", "--run-dir", str(run_dir), "--no-tensorboard")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run_dir / "metrics.jsonl").exists() and not (run_dir / "tb").exists()
