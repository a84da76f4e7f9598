"""Start the suite's node and bootstrap processes from a preloaded interpreter.

A `python -m node.cli` process spends about 7 s of CPU importing torch, transformers (with a model's modeling
code) and hivemind before it does anything; the suite starts about a hundred of them. This server imports
those libraries once (never any module of the node, which reads its environment at import) and forks a child
per request. The child becomes what a fresh `python -m MODULE ARGS` or `python -c CODE ARGS` would be: its
own session, the requested working directory, environment, argv and stdio, Python's default signal
handling, `__main__` run by runpy; it ends with the exit code the interpreter would give. The server reaps
its children and writes each one's return code to a file the test side reads (`Forked`, which stands in
for the `subprocess.Popen` it replaces).

Real interpreter starts stay covered: the CLI, signal, terminal and local-swarm tests, and the experiment
runner's peers, start fresh processes. `SAPO_TEST_FORKSERVER=0` turns the server off.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENABLED = os.environ.get("SAPO_TEST_FORKSERVER", "1") != "0"
# the environment the server imports its libraries in (huggingface_hub reads HF_HUB_OFFLINE at import):
# conftest sets it to the suite's, so it is not that of whichever test, perhaps with a patched environment,
# happens to start the first child
SERVER_ENV: dict[str, str] | None = None


class Forked:
    """The part of `subprocess.Popen`'s interface the tests use, for a child of the fork server."""

    def __init__(self, pid: int, status_file: Path):
        self.pid, self._status, self.returncode = pid, status_file, None

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            text = self._status.read_text().strip()
            if text:
                self.returncode = int(text)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Client:
    """This test process's server: started on first use, gone with the test process."""

    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0
        self.dir = Path(tempfile.mkdtemp(prefix="sapo-forkserver-"))  # the children's return codes
        env = SERVER_ENV or dict(os.environ)
        self.server = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            text=True,
            bufsize=1,
        )
        ready = self.server.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"fork server did not start: {ready!r}")
        atexit.register(self.close)

    def spawn(self, argv: list[str], cwd: Path, env: dict, out: Path, err: Path | None = None) -> Forked:
        with self.lock:
            self.count += 1
            status = self.dir / f"{self.count}.rc"
            request = {
                "argv": argv,
                "cwd": str(cwd),
                "env": env,
                "out": str(out),
                "err": str(err or out),
                "status": str(status),
            }
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            reply = self.server.stdout.readline()
        if not reply:
            raise RuntimeError("the fork server died")
        return Forked(int(reply), status)

    def close(self) -> None:
        if self.server.poll() is None:
            self.server.stdin.close()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_client: _Client | None = None
_failed: str | None = None


def usable() -> bool:
    """Is the server on (SAPO_TEST_FORKSERVER) and running? A server that cannot start is said once on
    stderr, and the tests start fresh interpreters instead: slower, never wrong."""
    global _client, _failed
    if not ENABLED or _failed is not None:
        return False
    if _client is None:
        try:
            _client = _Client()
        except Exception as exc:
            _failed = f"{type(exc).__name__}: {exc}"
            print(f"tests/forkserver.py: not used ({_failed}); starting fresh interpreters", file=sys.stderr)
            return False
    return True


def spawn(argv: list[str], cwd: Path, env: dict, out: Path, err: Path | None = None) -> Forked:
    """`python *argv` (argv starts with -m MODULE or -c CODE), stdin empty, stdout appended to `out` and
    stderr to `err` (default: `out` too)."""
    if not usable():
        raise RuntimeError(f"the fork server is not in use ({_failed or 'SAPO_TEST_FORKSERVER=0'})")
    return _client.spawn(argv, cwd, env, out, err)


# ------------------------------------------------------------------------------------------- the server


def _preload() -> None:
    # numpy's and scipy's OpenBLAS each start a thread pool at import; no node computes with them (torch has
    # its own), and a single-threaded server forks cleanly
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import hivemind  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.generation.utils  # noqa: F401
    import transformers.models.gemma3.modeling_gemma3  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def _child(req: dict) -> None:
    """Become `python *argv`; never returns."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(req["out"], flags, 0o644), 1)
        os.dup2(os.open(req["err"], flags, 0o644), 2)
        os.closerange(3, 1 << 16)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import io

        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True, errors="backslashreplace"
        )
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        code = _run(req["argv"], req["cwd"])
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as Python ends on an uncaught KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # wait for non-daemon threads, as the interpreter does
        atexit._run_exitfuncs()
    finally:
        _flush()
        os._exit(code)


def _run(argv: list[str], cwd: str) -> int:
    import runpy

    mode, target, *rest = argv
    # what the interpreter puts at the head of sys.path: the script's place, then $PYTHONPATH
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [os.path.abspath(p) for p in extra if os.path.abspath(p) not in sys.path]
    if mode == "-m":
        sys.argv = ["-m", *rest]
        sys.path[0] = cwd
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif mode == "-c":
        sys.argv = ["-c", *rest]
        sys.path[0] = ""
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:
        raise SystemExit(f"fork server: unsupported argv {argv[:2]}")
    return 0


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _serve() -> None:
    _preload()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork copies only the calling thread: a library thread would be missing in the child
        print(f"not ready: {threads} threads after the imports", flush=True)
        return
    statuses: dict[int, str] = {}
    print("ready", flush=True)
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        while statuses:  # reap finished children: their return code, where the test side reads it
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            path = statuses.pop(pid, None)
            if path is not None:
                tmp = path + ".tmp"
                Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
                os.replace(tmp, path)
        if not sel.select(timeout=0.05):
            continue
        line = sys.stdin.readline()
        if not line:
            return  # the test process is gone; children live on in their own sessions, as Popen's would
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        statuses[pid] = req["status"]
        print(pid, flush=True)


if __name__ == "__main__":
    _serve()
