"""node/ops/quick_exit.py: the exit that skips the interpreter's teardown still does what teardown must."""

import subprocess
import sys

from conftest import REPO

SCRIPT = """
import atexit, sys, threading, time
from node.ops.quick_exit import exit_without_teardown
atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
if sys.argv[2] == "thread":  # a non-daemon thread that finishes after main: the exit must wait for it
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
sys.stdout.write("unflushed line")  # no newline, no flush: still delivered
exit_without_teardown(7)
"""


def run(tmp_path, mode):
    marker = tmp_path / f"marker-{mode}"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(marker), mode], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    return out, marker


def test_exit_code_atexit_handlers_and_buffered_output_survive(tmp_path):
    out, marker = run(tmp_path, "plain")
    assert out.returncode == 7, out.stderr
    assert out.stdout == "unflushed line"
    assert marker.read_text() == "atexit ran"


def test_a_live_non_daemon_thread_is_waited_for(tmp_path):
    out, marker = run(tmp_path, "thread")
    assert out.returncode == 7, out.stderr
    assert "thread done" in out.stdout
    assert marker.read_text() == "atexit ran"
