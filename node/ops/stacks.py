"""Stack dumps a node survives: `kill -USR1 <pid>` prints every thread's Python stack on stderr and the node
goes on; a crash prints its stacks under "Fatal Python error", so the two never read alike.

Why not `faulthandler.register(SIGUSR1)`: its dump runs inside the C signal handler and walks the frames
of threads that are running Python code at that moment (the model thread, hivemind's threads) without the
GIL. On a busy machine it read a frame as it was being freed and the node died of SIGSEGV in the middle
of its own dump (the flaky-test hunt: 1 of 4 runs of 300 dumps under load; the e2e test that asked for a dump saw
the dump's first lines, then a dead node). A Python-level handler runs in the main thread holding the
GIL, so every other thread stands still between bytecodes while its frames are read: the dump is whole
and cannot crash, provided the GIL is never let go until every chain is read: `traceback.extract_stack`
reads source lines from disk (file I/O releases the GIL), and a thread that popped its frames meanwhile
left the next `f_back` pointing at freed memory (measured: a SIGSEGV in 1 of 5 runs of 300 dumps, Python
3.11). So frames are read first, with nothing that releases the GIL (no I/O, no garbage collection),
and formatted after. The handler runs when the main thread next runs Python; the event loop waits in
select(), which the signal interrupts, so a node that seems stuck still answers at once. A process
wedged in C with the GIL held cannot run it: SIGUSR2 keeps faulthandler's C dump for that last resort,
risk included.

Forked children (hivemind's DHT process) inherit the handler: a signal sent to the whole process group
makes each print its own stacks under its own pid.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import sys
import threading
from types import FrameType

DUMP_BEGIN = "--- stack dump on SIGUSR1"
DUMP_END = "--- end of stack dump"


def read_stacks() -> list[tuple[int, list[tuple[str, int, str]]]]:
    """(thread id, [(file, line, function), most recent call first]) for every thread, all read while this
    thread holds the GIL: attribute reads only, the collector off (a finalizer could let the GIL go)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        stacks: list[tuple[int, list[tuple[str, int, str]]]] = []
        for ident, top in sys._current_frames().items():
            calls = []
            frame: FrameType | None = top
            while frame is not None:
                code = frame.f_code
                calls.append((code.co_filename, frame.f_lineno, code.co_name))
                frame = frame.f_back
            stacks.append((ident, calls))
        return stacks
    finally:
        if collecting:
            gc.enable()


def format_stacks(owner_pid: int) -> str:
    """Every thread's stack, most recent call first (as faulthandler prints them), named and labelled."""
    pid = os.getpid()
    who = f"pid {pid}" if pid == owner_pid else f"pid {pid}, a forked child of {owner_pid}"
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = read_stacks()
    lines = [f"{DUMP_BEGIN} ({who}): {len(stacks)} threads ---"]
    for ident, calls in stacks:
        current = " (current)" if ident == threading.get_ident() else ""
        lines.append(f"Thread {ident:#x} {names.get(ident, '?')!r}{current} (most recent call first):")
        lines += [f'  File "{path}", line {line} in {name}' for path, line, name in calls]
    lines.append(f"{DUMP_END} ({who}) ---")
    return "\n".join(lines) + "\n"


def install_stack_dumps(fd: int = 2) -> None:
    """SIGUSR1: every thread's stack on `fd` (stderr), then carry on. SIGUSR2: faulthandler's C-level dump
    for a process whose main thread cannot run Python. Fatal signals: faulthandler's crash report."""
    owner = os.getpid()

    def dump(_signum, _frame) -> None:
        data = format_stacks(owner).encode(errors="replace")
        try:  # straight to the fd: no stream lock the interrupted main thread might hold
            while data:
                data = data[os.write(fd, data) :]
        except OSError:
            pass  # the console is gone (node.log keeps the log): a dump must never stop the node

    signal.signal(signal.SIGUSR1, dump)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    faulthandler.enable(all_threads=True)
