"""tests/forkserver.py: a child of the preloaded interpreter is what `python -m`/`python -c` would start: the
requested argv, working directory, environment and streams, its own session, Python's signal handling, and
the exit code the interpreter would give."""

import os
import signal
import subprocess
import sys
import time

import pytest

import forkserver

pytestmark = pytest.mark.skipif(not forkserver.ENABLED, reason="SAPO_TEST_FORKSERVER=0")


def setup_module():
    assert forkserver.usable(), "the fork server did not start (its reason is on stderr)"


REPORT = """
import json, os, signal, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
                  "sid": os.getsid(0) == os.getpid(),
                  "int": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "path0": sys.path[0]}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_child_gets_argv_cwd_env_streams_session_signals_and_exit_code(tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    child = forkserver.spawn(
        ["-c", REPORT, "3", "x y"], tmp_path, {"PROBE": "seen", "PATH": os.environ["PATH"]}, out, err
    )
    assert child.wait(60) == 3
    import json

    seen = json.loads(out.read_text())
    assert seen == {
        "argv": ["-c", "3", "x y"],
        "cwd": str(tmp_path),
        "env": "seen",
        "sid": True,
        "int": True,
        "term": True,
        "path0": "",
    }
    assert err.read_text() == "to stderr\n"


def test_a_module_runs_as_main_and_a_signal_or_an_uncaught_error_ends_it_as_python_would(tmp_path):
    out = tmp_path / "out"
    done = forkserver.spawn(["-m", "node.cli", "--version"], tmp_path, dict(os.environ), out)
    assert done.wait(60) == 0 and out.read_text().strip(), out.read_text()
    fresh = subprocess.run(
        [sys.executable, "-m", "node.cli", "--version"],
        capture_output=True,
        text=True,
        cwd=forkserver.Path(forkserver.__file__).resolve().parents[1],
        timeout=60,
    )
    assert out.read_text() == fresh.stdout + fresh.stderr

    sleeper = forkserver.spawn(
        ["-c", "import time; print('up', flush=True); time.sleep(60)"], tmp_path, dict(os.environ), tmp_path / "sleep"
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "sleep").exists() or "up" not in (tmp_path / "sleep").read_text():
        assert sleeper.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    sleeper.send_signal(signal.SIGTERM)
    assert sleeper.wait(30) == -signal.SIGTERM

    interrupted = forkserver.spawn(["-c", "raise KeyboardInterrupt"], tmp_path, dict(os.environ), tmp_path / "ki")
    assert interrupted.wait(30) == -signal.SIGINT  # as Python ends on an uncaught KeyboardInterrupt
    crashed = forkserver.spawn(["-c", "raise ValueError('boom')"], tmp_path, dict(os.environ), tmp_path / "crash")
    assert crashed.wait(30) == 1 and "ValueError: boom" in (tmp_path / "crash").read_text()
