"""Console progress: one-line formatting, live/plain printer, and the metrics.jsonl tail CLI."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys
import time

import orjson
import pytest

from node.ops import progress
from node.ops.progress import MetricsTail, ProgressPrinter, RunView, format_progress_line, format_table, main

pytestmark = pytest.mark.timeout(60)


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_format_round_record():
    rec = {
        "round": 12,
        "reward_mean": 0.41234,
        "num_local": 6,
        "num_external": 2,
        "round_s": 31.25,
        "phase_s": {"generate": 20},
        "peer": "alice",
    }
    line = format_progress_line(rec)
    assert line == "[alice] | round 12 | reward 0.412 | ext 2/8 | 31.2s"
    assert "\n" not in line


def test_format_snapshot():
    snap = {
        "peer_id": "12D3KooWAbcdefghijklmnop",
        "round": 3,
        "phase": "train",
        "last_reward": 0.5,
        "reward_ma": 0.25,
        "history": [{"round": 2, "num_local": 4, "num_external": 4}],
        "phase_s": {"generate": 1.5, "train": 2.0},
    }
    line = format_progress_line(snap)
    assert "round 3" in line and "reward 0.500" in line and "ma 0.250" in line
    assert "ext 4/8" in line and "phase train" in line and "3.5s" in line
    assert line.startswith("[12D3Ko…")


def test_the_network_lag_shows_when_the_network_runs_behind_the_round():
    rec = {"round": 4, "num_local": 2, "num_external": 2, "net_pipeline": True, "external_age_s": [3.0, 1.25, 2.0]}
    assert "net lag 2.0s" in format_progress_line(rec)
    assert "net lag" not in format_progress_line({**rec, "net_pipeline": False})  # in line: no lag to show
    snap = {"round": 4, "network": {"pipeline": True, "median_age_s": 1.5, "groups_waiting": 3}}
    assert "net lag 1.5s, 3 waiting" in format_progress_line(snap)
    assert "net lag -" in format_progress_line({"network": {"pipeline": True, "median_age_s": None}})
    assert "net lag" not in format_progress_line({"network": {"pipeline": False}})


def test_held_out_accuracy_shows_against_the_constant_answer_baseline():
    rec = {
        "round": 10,
        "reward_mean": 0.5,
        "peer": "bob",
        "eval_accuracy": 0.4219,
        "eval_baseline": 0.1367,
        "eval_unseen_accuracy": 0.25,
        "eval_unseen_baseline": 0.168,
    }
    line = format_progress_line(rec)
    assert line.endswith("| held-out 0.422 (const 0.137) | unseen 0.250 (const 0.168)")
    snap = {"round": 12, "last_reward": 0.5, "eval": {"round": 10, "eval_accuracy": 0.4, "eval_baseline": 0.125}}
    assert format_progress_line(snap).endswith("| held-out 0.400 (const 0.125)")  # no unseen set: not shown
    assert "held-out" not in format_progress_line({"round": 11, "reward_mean": 0.5})


def test_a_practising_node_shows_each_part():
    """--practise: the accuracy of the part the node samples and of the rest, which it learns from its peers."""
    rec = {"round": 3, "reward_mean": 0.5, "eval_accuracy": 0.5, "eval_baseline": 0.125}
    rec |= {"eval_accuracy_practised": 0.75, "eval_accuracy_other": 0.25, "eval_unseen_accuracy": 0.2}
    line = format_progress_line(rec | {"eval_unseen_accuracy_practised": 0.4})
    assert line.endswith(
        "| held-out 0.500 (const 0.125; practised 0.750, other 0.250) | unseen 0.200 (practised 0.400)"
    )


def test_table_shows_each_peers_last_evaluation(tmp_path):
    evals = {"eval_accuracy": 0.375, "eval_baseline": 0.125}
    _write(tmp_path / "a", [{"round": 0, "reward_mean": 0.1, **evals}, {"round": 1, "reward_mean": 0.2}])
    _write(
        tmp_path / "b",
        [{"round": 0, "reward_mean": 0.1, **evals, "eval_unseen_accuracy": 0.0625, "eval_unseen_baseline": 0.1875}],
    )
    views = [RunView(tmp_path / n, MetricsTail(tmp_path / n / "metrics.jsonl")) for n in ("a", "b")]
    for v in views:
        v.poll()
    lines = format_table(views).splitlines()
    assert "held-out (const)" in lines[0] and "unseen (const)" in lines[0]
    assert "0.375 (const 0.125) @0" in lines[2] and lines[2].split()[2] == "1"  # last round 1, eval of round 0
    assert "0.062 (const 0.188) @0" in lines[3]
    assert "unseen" not in format_table(views[:1])  # no peer with an unseen set: no such column


def test_format_is_robust():
    assert "round -" in format_progress_line({})
    hostile = format_progress_line({"peer": "evil\x1b[2J\rname" * 5, "round": 1, "reward_mean": None})
    assert "\x1b" not in hostile and "\r" not in hostile and "reward -" in hostile


def test_printer_plain_stream():
    out = io.StringIO()
    p = ProgressPrinter(out)
    p.update({"round": 1, "reward_mean": 0.1, "peer": "a"})
    p.update({"round": 1, "reward_mean": 0.1, "peer": "a"})  # unchanged: not repeated
    p.update({"round": 2, "reward_mean": 0.2, "peer": "a"})
    p.message("hello")
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == ["[a] | round 1 | reward 0.100", "[a] | round 2 | reward 0.200", "hello"]
    assert "\r" not in out.getvalue()


def test_printer_tty_rewrites_one_line():
    out = FakeTTY()
    with ProgressPrinter(out, width=40) as p:
        p.update({"round": 1, "reward_mean": 0.1, "peer": "a"})
        p.update(
            {
                "round": 2,
                "reward_mean": 0.2,
                "peer": "a",
                "num_external": 3,
                "num_local": 5,
                "phase": "generate",
                "round_s": 100.0,
            }
        )
        p.message("checkpoint saved")
    text = out.getvalue()
    assert text.count("\r") >= 3
    assert text.endswith("\n")
    assert "checkpoint saved\n" in text
    # every live line is clipped to the terminal width
    for chunk in text.split("\r"):
        visible = chunk.replace("\x1b[K", "").split("\n")[0]
        assert len(visible) <= 40


def test_metrics_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read_new() == []  # missing file is fine
    path.write_bytes(b'{"round": 1}\nnot json\n{"round": 2')
    assert [r["round"] for r in tail.read_new()] == [1]
    assert tail.bad_lines == 1
    with open(path, "ab") as f:
        f.write(b', "reward_mean": 0.5}\n')
    assert tail.read_new() == [{"round": 2, "reward_mean": 0.5}]
    assert tail.read_new() == []
    path.write_bytes(b'{"round": 9}\n')  # truncated / rewritten
    assert tail.read_new() == [{"round": 9}]


def _write(run, recs):
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "metrics.jsonl", "ab") as f:
        for r in recs:
            f.write(orjson.dumps(r) + b"\n")


def test_table_and_once(tmp_path, capsys):
    _write(
        tmp_path / "n0",
        [
            {"round": r, "reward_mean": r / 10, "num_local": 4, "num_external": 1, "round_s": 2.0, "peer": "alice"}
            for r in range(1, 4)
        ],
    )
    view = RunView(tmp_path / "n0", MetricsTail(tmp_path / "n0" / "metrics.jsonl"))
    view.poll()
    table = format_table([view, RunView(tmp_path / "n1", MetricsTail(tmp_path / "n1" / "metrics.jsonl"))])
    assert "alice" in table and "waiting" in table and "0.200" in table  # ma of 0.1, 0.2, 0.3

    assert main([str(tmp_path / "n0"), str(tmp_path / "n1"), "--once"]) == 0
    out = capsys.readouterr().out
    assert "alice" in out and "n1" in out


def _read_until(proc: subprocess.Popen, needle: bytes, timeout: float) -> bytes:
    """Read the child's stdout until `needle` shows up (or time out), without blocking forever."""
    got, deadline = b"", time.monotonic() + timeout
    while needle not in got and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["terminal", "started-with-&"])
def test_cli_follows_and_exits_on_ctrl_c(tmp_path, sigint_ignored):
    """Ctrl-C ends the view quietly, also when a script started it with `&` (SIGINT inherited as ignored)."""
    run = tmp_path / "node-a"
    _write(run, [{"round": 1, "reward_mean": 0.1, "num_local": 4, "num_external": 0, "peer": "alice"}])
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.ops.progress", str(run), "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=ignore,
    )
    try:
        first = _read_until(proc, b"alice", 60)  # it is up and watching
        assert b"alice" in first, first
        _write(run, [{"round": 2, "reward_mean": 0.7, "num_local": 4, "num_external": 3, "peer": "alice"}])
        first += _read_until(proc, b"round 2", 30)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = (first + rest).decode(), err.decode()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "peer" in out.splitlines()[0]  # initial table
    assert "[alice] | round 2 | reward 0.700 | ma 0.400 | ext 3/7" in out


def test_the_next_evaluation_shows_in_the_line_and_the_table(tmp_path):
    """Records say after which round the next held-out evaluation comes (eval_next): the console line and the
    table show it; runs whose records do not say get no such column."""
    rec = {"round": 4, "reward_mean": 0.5, "peer": "carol", "eval_next": 6}
    assert format_progress_line(rec).endswith("| next eval after round 6")
    snap = {"round": 5, "last_reward": 0.5, "history": [{"round": 4, "eval_next": 6}]}
    assert format_progress_line(snap).endswith("| next eval after round 6")
    assert "next eval" not in format_progress_line({"round": 9, "reward_mean": 0.5, "eval_next": None})
    _write(tmp_path / "a", [{"round": 0, "reward_mean": 0.1, "eval_accuracy": 0.5, "eval_next": 3}])
    _write(tmp_path / "b", [{"round": 0, "reward_mean": 0.1}])
    views = [RunView(tmp_path / n, MetricsTail(tmp_path / n / "metrics.jsonl")) for n in ("a", "b")]
    for v in views:
        v.poll()
    lines = format_table(views).splitlines()
    assert "next eval" in lines[0] and "after 3" in lines[2] and "after" not in lines[3]
    assert "next eval" not in format_table(views[1:])


def test_unreadable_lines_are_skipped_and_said(tmp_path, monkeypatch):
    """Garbage in a peer's metrics.jsonl: the table and the plain view leave it out and say how many lines."""
    run = tmp_path / "n0"
    metrics = run / "metrics.jsonl"
    _write(run, [{"round": 1, "reward_mean": 0.1, "peer": "alice"}])
    view = RunView(run, MetricsTail(metrics))
    view.poll()
    assert "unreadable" not in format_table([view])
    with open(metrics, "ab") as f:
        f.write(b"garbage\n[1, 2]\n")
    _write(run, [{"round": 2, "reward_mean": 0.2, "peer": "alice"}])
    view.poll()
    assert format_table([view]).splitlines()[-1] == f"alice: 2 unreadable lines in {metrics} skipped"

    refreshes = []

    def sleep(_: float) -> None:  # the plain view's first table, then one refresh after a line cut short
        if refreshes:
            raise KeyboardInterrupt
        refreshes.append(1)
        with open(metrics, "ab") as f:
            f.write(b'{"round": 3, "rew\n')

    monkeypatch.setattr(progress.time, "sleep", sleep)
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        progress._watch([RunView(run, MetricsTail(metrics))], out, 0.1, once=False, live=False)
    assert out.getvalue().splitlines()[-1] == f"alice: 3 unreadable lines in {metrics} skipped"
    metrics.write_bytes(b'{"round": 0, "peer": "alice"}\n')  # rewritten (a resume moved the bad lines out)
    view.poll()
    assert "unreadable" not in format_table([view])


def test_what_is_not_a_metrics_file_is_read_as_nothing_yet(tmp_path):
    """RUN_DIR a file, metrics.jsonl a directory or a FIFO (whose read would block the view forever)."""
    (tmp_path / "afile").write_text("x")
    assert MetricsTail(tmp_path / "afile" / "metrics.jsonl").read_new() == []
    (tmp_path / "d" / "metrics.jsonl").mkdir(parents=True)
    assert MetricsTail(tmp_path / "d" / "metrics.jsonl").read_new() == []
    os.mkfifo(tmp_path / "fifo")
    assert MetricsTail(tmp_path / "fifo").read_new() == []


@pytest.mark.parametrize("interval", ["inf", "nan", "0", "1e300"])
def test_an_interval_time_sleep_refuses_is_a_usage_error(tmp_path, interval, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), "--interval", interval])
    assert exit_.value.code == 2 and "--interval must be seconds" in capsys.readouterr().err
