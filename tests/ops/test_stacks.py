"""Stack dumps on SIGUSR1 (node/ops/stacks.py): every thread's stack, most recent call first, taken while
other threads run Python code, as often as asked, and the process goes on; a real node survives a burst of
them mid-round (faulthandler's dump, used before, killed a busy node with SIGSEGV)."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, live_metrics, node_env
from node.ops.stacks import DUMP_BEGIN, DUMP_END, format_stacks


def busy_worker(running: threading.Event, stop: threading.Event) -> None:
    def deeper(n: int) -> int:  # pushes and pops frames all the time, as the model thread does
        return n if n == 0 else 1 + deeper(n - 1)

    running.set()
    while not stop.is_set():
        deeper(30)


def test_dumps_name_every_thread_most_recent_call_first_while_threads_run():
    running, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=busy_worker, args=(running, stop), name="model-like")
    worker.start()
    try:
        assert running.wait(30)
        for _ in range(300):
            text = format_stacks(os.getpid())
        assert text.startswith(DUMP_BEGIN) and text.rstrip().endswith("---") and DUMP_END in text
        blocks = text.split("Thread 0x")[1:]
        # every thread Python knows is named (a test runner may own threads started outside `threading`)
        assert len(blocks) >= threading.active_count()
        assert all(f"'{t.name}'" in text for t in threading.enumerate())
        mine = next(b for b in blocks if "(current)" in b)
        assert "'MainThread'" in mine
        assert mine.index("in format_stacks") < mine.index("in test_dumps_name_every_thread")  # newest first
        busy = next(b for b in blocks if "'model-like'" in b)
        assert "in busy_worker" in busy, busy  # (in deeper, or between two calls of it)
    finally:
        stop.set()
        worker.join()
    assert f"a forked child of {os.getpid() + 1}" in format_stacks(os.getpid() + 1)


@pytest.mark.slow
def test_a_node_survives_a_burst_of_dumps_mid_round(tmp_path):
    run_dir = tmp_path / "run"
    out = tmp_path / "node.out"
    args = [
        "--model",
        "tiny-random",
        "--tasks",
        "smoke",
        "--num-local",
        "2",
        "--generations",
        "4",
        "--max-new-tokens",
        "8",
        "--rounds",
        "100000",
        "--eval-every",
        "0",
        "--no-tensorboard",
        "--run-dir",
        str(run_dir),
    ]
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "node.cli", *args], cwd=REPO, env=node_env(), stdout=fh, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 120
        while not live_metrics(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        for _ in range(300):  # while it samples, trains and records
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.01)
        done = len(live_metrics(run_dir))
        while len(live_metrics(run_dir)) < done + 2:  # and it goes on with its rounds
            assert proc.poll() is None, f"the node died (exit code {proc.returncode}):\n{out.read_text()[-3000:]}"
            assert time.monotonic() < deadline + 60, "no round after the dumps"
            time.sleep(0.2)
        text = out.read_text(errors="replace")
        assert text.count(DUMP_END) >= 10 and "Fatal Python error" not in text  # signals may coalesce
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, out.read_text()[-3000:]
