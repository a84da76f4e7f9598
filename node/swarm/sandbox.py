"""A peer's completions are scored in a child process that can be stopped.

reasoning-gym's scorers are written for a model's honest answers, not for an adversary's: some take time or
memory exponential in a short answer (`propositional_logic`, in the paper's mix, builds every assignment of
the variables an answer names: 19 names, 56 characters, take 10 s and 1 GB), and a Python loop or a sympy
call cannot be interrupted from another thread. So a receiver scores another peer's group in one child
process (started on first use: about 0.3 s, 50 MB, 90 MB once sympy's datasets load) under a memory limit
(Linux: the address space after its imports plus 2 GiB; first in line for the OOM killer), and gives up on a
group that takes longer than its time limit, or runs out of that memory: the child is killed (the next group
starts a fresh one), the group is dropped as `unscored`, and its publisher is not charged (a slow or small
machine is no proof of anything). A node's own completions are scored in-process: they come from its own model.

Run as `python -m node.swarm.sandbox`: the child, reading one JSON request per line on stdin and answering
one JSON line on stdout.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from p2p.parent_death import die_with_parent

log = logging.getLogger("sapo.node")

MEMORY_LIMIT_MB = 2048  # the child's address space beyond what it has after its imports
GROUP_TIME_S = 5.0  # a group's time limit: this, plus PER_COMPLETION_S for each completion
PER_COMPLETION_S = 0.5
START_TIME_S = 60.0  # the child's start (its imports), apart from any group's time limit
READY = "ready"
ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the `node` package: the child's cwd


def group_time_limit(completions: int, base_s: float = GROUP_TIME_S) -> float:
    """Far above an honest group's scoring (milliseconds for arithmetic, a fraction of a second for sympy's)."""
    return base_s + PER_COMPLETION_S * completions


class ScoringSandbox:
    """The child process and its pipe; one request at a time (a lock), so peers of one process can share it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.kills = 0  # children stopped: past a group's time, out of memory, dead, or not started
        self._logged_at = -float("inf")
        self._closed: subprocess.Popen | None = None  # the child `close` stopped: replaced without a word

    def score(self, spec: dict[str, Any], responses: list[str], time_limit_s: float) -> list[float] | None:
        """The rewards of `responses` to the task `spec` (TaskSpec.to_wire()), as `score_responses` gives them;
        None when the child did not answer within `time_limit_s` (counted from when it has the group; it is
        stopped) or could not score them (out of its memory)."""
        request = json.dumps({"spec": spec, "responses": responses}) + "\n"
        with self._lock:
            proc = self._child()
            if proc is None:
                return None
            line = None
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(request)
                proc.stdin.flush()
                line = _read_line(proc.stdout, time.monotonic() + time_limit_s)
            except (OSError, ValueError):
                pass
            answer = _reply(line)
            if answer is None:  # no answer in time, the child's end, or not a reply of ours
                self._replace(proc, f"gave no reply within {time_limit_s:.1f} s")
                return None
        rewards = answer.get("rewards")
        return [float(r) for r in rewards] if isinstance(rewards, list) else None

    def warm(self) -> bool:
        """Start the child now, if it is not running (its start-up, seconds on a loaded machine, would otherwise
        fall within the first verification's time budget). Whether it runs."""
        with self._lock:
            return self._child() is not None

    def close(self) -> None:
        """Stop the child now: a scorer it runs ends with it, and a `score` waiting on it returns None at once.
        The next `score` starts another."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._closed = proc
            proc.kill()

    def _child(self) -> subprocess.Popen | None:
        """The running child, started if need be (and waited for, apart from any group's time); None if it
        does not start."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:
            self._replace(proc, f"exited with code {proc.returncode}")
        proc = subprocess.Popen(
            [sys.executable, "-m", "node.swarm.sandbox", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            cwd=ROOT,  # `-m` looks in the cwd first: never another directory's `node`
            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
            start_new_session=True,  # a terminal's Ctrl-C goes to the node, which stops the child itself
        )
        assert proc.stdout is not None
        if _read_line(proc.stdout, time.monotonic() + START_TIME_S) != READY + "\n":
            self._replace(proc, "did not start")
            return None
        self._proc = proc
        return proc

    def _replace(self, proc: subprocess.Popen, why: str) -> None:
        """Stop `proc` and forget it; unless `close` stopped it, count it and say so in node.log (at most once
        a minute: a flood of costly answers would otherwise flood the log)."""
        if self._proc is proc:
            self._proc = None
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        if proc is self._closed:
            return
        self.kills += 1
        if time.monotonic() - self._logged_at >= 60:
            self._logged_at = time.monotonic()
            log.warning("scoring sandbox: the child %s; replaced (%d so far)", why, self.kills)


def _reply(line: str | None) -> dict | None:
    try:
        answer = json.loads(line) if line is not None else None
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _read_line(stream, deadline: float) -> str | None:
    """One line from the child, or None at the deadline or at its end."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([stream], [], [], remaining)
        if ready:
            line = stream.readline()
            return line if line.endswith("\n") else None


SANDBOX = ScoringSandbox()  # one child per process, shared by its peers (memory mode runs several)


def _limit_memory() -> None:
    """The address space this process has now, plus MEMORY_LIMIT_MB: a scorer that asks for more gets a
    MemoryError (scored 0 by `score`), not the machine's memory."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = size + MEMORY_LIMIT_MB * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (OSError, ValueError, ImportError):
        pass  # no /proc (not Linux): the time limit still holds


def _first_for_the_oom_killer() -> None:
    """Where memory runs out (a container's limit below the node's memory plus ours), the kernel kills us, not
    the node."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def serve(parent_pid: int) -> None:
    die_with_parent(parent_pid)  # a node killed outright (SIGKILL, the OOM killer) takes its scorer with it
    _first_for_the_oom_killer()
    # replies go to the original stdout; whatever a dataset or scorer prints (some do) goes to stderr
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from node.learn.tasks import TaskError, TaskSpec, regenerate, score_responses

    _limit_memory()
    replies.write(READY + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            task = regenerate(TaskSpec.make(**request["spec"]))
            # out of our memory is no score: the publisher, without our limit, may have scored it
            answer: dict[str, Any] = {"rewards": score_responses(task, request["responses"], memory_errors=True)}
        except (TaskError, ValueError, KeyError, TypeError, MemoryError) as exc:
            answer = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid())
