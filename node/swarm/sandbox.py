"""A peer's completions are scored in a child process that can be stopped.

reasoning-gym's scorers are written for a model's honest answers, not for an adversary's: some take time or
memory exponential in a short answer (`propositional_logic`, in the paper's mix, builds every assignment of
the variables an answer names: 19 names, 56 characters, take 10 s and 1 GB), and a Python loop or a sympy
call cannot be interrupted from another thread. So a receiver scores another peer's group in one child
process (started on first use, about 0.5 s of CPU and 50 MB) under a memory limit, and gives up on a group
that takes longer than its time limit: the child is killed (the next group starts a fresh one), the group is
dropped as `score_timeout`, and its publisher is not charged (a slow machine is no proof of anything).
A node's own completions are scored in-process: they come from its own model.

Run as `python -m node.swarm.sandbox`: the child, reading one JSON request per line on stdin and answering
one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

MEMORY_LIMIT_MB = 2048  # the child's address space beyond what it has after its imports
GROUP_TIME_S = 5.0  # a group's time limit: this, plus PER_COMPLETION_S for each completion
PER_COMPLETION_S = 0.5


def group_time_limit(completions: int, base_s: float = GROUP_TIME_S) -> float:
    """Far above an honest group's scoring (milliseconds for arithmetic, a fraction of a second for sympy's)."""
    return base_s + PER_COMPLETION_S * completions


class ScoringSandbox:
    """The child process and its pipe; one request at a time (a lock), so peers of one process can share it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.kills = 0  # children stopped for running past their time (or found dead)

    def score(self, spec: dict[str, Any], responses: list[str], time_limit_s: float) -> list[float] | None:
        """The rewards of `responses` to the task `spec` (TaskSpec.to_wire()), as `score_responses` gives them;
        None when the child did not answer within `time_limit_s` (it is stopped) or could not score them."""
        request = json.dumps({"spec": spec, "responses": responses}) + "\n"
        deadline = time.monotonic() + time_limit_s
        with self._lock:
            proc = self._child()
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(request)
                proc.stdin.flush()
                line = _read_line(proc.stdout, deadline)
            except (OSError, ValueError):
                line = None
            try:
                answer = json.loads(line) if line is not None else None
            except ValueError:
                answer = None
            if not isinstance(answer, dict):  # no answer in time, the child's end, or not a reply of ours
                self._stop()
                self.kills += 1
                return None
        rewards = answer.get("rewards")
        return [float(r) for r in rewards] if isinstance(rewards, list) else None

    def close(self) -> None:
        """Stop the child now (a scorer it runs ends with it); the next `score` starts another."""
        self._stop()

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "node.swarm.sandbox"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                start_new_session=True,  # a terminal's Ctrl-C goes to the node, which stops the child itself
            )
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout) if proc is not None else ():
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


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
        pass  # not Linux: the time limit still holds


def serve() -> None:
    # replies go to the original stdout; whatever a dataset or scorer prints (some do) goes to stderr
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from node.learn.tasks import TaskError, TaskSpec, regenerate, score_responses

    _limit_memory()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            task = regenerate(TaskSpec.make(**request["spec"]))
            answer: dict[str, Any] = {"rewards": score_responses(task, request["responses"])}
        except (TaskError, ValueError, KeyError, TypeError, MemoryError) as exc:
            answer = {"error": str(exc)[:200]}
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
