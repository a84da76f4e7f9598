"""RUN_DIR/tb/: the event files say what metrics.jsonl says, a restart rebuilds them, a failing writer is harmless."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from node.ops.tensorboard import SCALARS, TensorBoardLog, scalars
from tbread import read_events, read_scalars


def record(r: int, **extra) -> dict:
    rec = {
        "round": r,
        "t_end": 1_700_000_000.0 + r,
        "reward_mean": 0.1 * r + 0.05,
        "reward_max": 1.0,
        "loss": -0.01 * r,
        "kl": 0.002 * r,
        "clip_frac": 0.03,
        "entropy_mean": 2.5 - 0.1 * r,
        "signal_frac": 0.4,
        "num_local": 2,
        "num_external": r % 3,
        "external_rejected": 2,
        "rejected_by_reason": {"bad_signature": 1, "banned": 1},
        "phase_s": {"generate": 1.5, "train": 0.25},
        "peak_mem_mb": 812.4,
        "ij_policy": "fixed",
        "external_sources": {"abcd": 1},
    }
    rec.update(extra)
    return rec


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def f32(x: float) -> float:
    return float(np.float32(x))  # event files hold float32 scalars


def test_scalars_of_a_record():
    tags = scalars(record(2, eval_accuracy=0.6, eval_baseline=0.5625, **{"eval_accuracy/count_bits": 0.75}))
    assert tags["reward/mean"] == 0.25 and tags["train/kl"] == 0.004 and tags["memory/peak_mb"] == 812.4
    assert tags["groups/rejected/bad_signature"] == 1 and tags["time/phase/generate"] == 1.5
    assert tags["eval/accuracy"] == 0.6 and tags["eval/constant_answer_baseline"] == 0.5625
    assert tags["eval/accuracy/count_bits"] == 0.75
    assert not any("ij_policy" in t or "sources" in t for t in tags)  # strings and per-peer maps stay out
    assert "eval/accuracy" not in scalars(record(1))  # a round without evaluation has no accuracy point
    unseen = scalars(
        record(
            2,
            eval_accuracy=0.6,
            eval_unseen_accuracy=0.3,
            eval_unseen_baseline=0.17,
            **{"eval_unseen_accuracy/chain_sum": 0.25, "eval_unseen_scores": [1.0, 0.0]},
        )
    )
    assert unseen["eval/unseen_accuracy"] == 0.3 and unseen["eval/unseen_constant_answer_baseline"] == 0.17
    assert unseen["eval/unseen_accuracy/chain_sum"] == 0.25 and "eval/accuracy/chain_sum" not in unseen
    assert not [t for t in tags if "unseen" in t]  # a mix without an unseen set has no such curve


def test_event_files_equal_metrics_and_restart_rebuilds(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [record(r) for r in range(3)]
    write_metrics(metrics, records)
    tb = TensorBoardLog(tmp_path)
    assert tb.rebuild(metrics) == 3
    extra = record(3, eval_accuracy=0.5, eval_baseline=0.5625)
    tb.write(extra)
    tb.close()
    got = read_scalars(tmp_path / "tb")
    for rec in records + [extra]:
        for tag, value in scalars(rec).items():
            assert (rec["round"], f32(value)) in got[tag], tag
    assert [s for s, _ in got["reward/mean"]] == [0, 1, 2, 3]
    assert got["eval/constant_answer_baseline"] == [(3, f32(0.5625))]
    events = read_events(next((tmp_path / "tb").glob("events.out.tfevents.*")))
    assert events[0].file_version == "brain.Event:2"
    assert [e.wall_time for e in events if e.step == 2 and e.summary.value] == [records[2]["t_end"]]

    # a restart after a resume from round 1: metrics.jsonl lost rounds 2 and 3, round 2 is redone
    redone = record(2, reward_mean=0.9)
    write_metrics(metrics, records[:2] + [redone])
    tb = TensorBoardLog(tmp_path)
    assert tb.rebuild(metrics) == 3
    tb.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    got = read_scalars(tmp_path / "tb")
    assert got["reward/mean"] == [(0, f32(0.05)), (1, f32(0.15)), (2, f32(0.9))]  # each step once, no round 3


def test_disabled_writes_nothing(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [record(0)])
    tb = TensorBoardLog(tmp_path, enabled=False)
    assert tb.rebuild(tmp_path / "metrics.jsonl") == 0
    tb.write(record(1))
    tb.close()
    assert not (tmp_path / "tb").exists()


def test_a_failing_writer_logs_once_and_turns_off(tmp_path, caplog):
    (tmp_path / "tb").write_text("a file where the directory should be")
    tb = TensorBoardLog(tmp_path)
    with caplog.at_level(logging.WARNING, logger="sapo.tensorboard"):
        assert tb.rebuild(tmp_path / "metrics.jsonl") == 0
        tb.write(record(0))
        tb.write(record(1))
    assert not tb.enabled
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1


def test_a_write_error_mid_run_turns_off(tmp_path, caplog):
    tb = TensorBoardLog(tmp_path)
    tb.rebuild(tmp_path / "metrics.jsonl")

    class Broken:
        def write_event(self, event):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    tb._writer = Broken()
    with caplog.at_level(logging.WARNING, logger="sapo.tensorboard"):
        tb.write(record(0))
        tb.write(record(1))
    assert not tb.enabled and "No space left" in caplog.text


@pytest.mark.parametrize("key", sorted(SCALARS))
def test_every_mapped_key_is_a_metrics_field(key):
    """A tag for a key the node never writes would be a silent empty chart: docs/OUTPUTS.md lists every field."""
    from pathlib import Path

    outputs = (Path(__file__).resolve().parents[2] / "docs" / "OUTPUTS.md").read_text()
    assert f"`{key}`" in outputs
