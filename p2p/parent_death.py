"""A child process that cannot outlive its parent (Linux): killed when the thread that started it ends."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent(parent_pid: int) -> bool:
    """In the child: be SIGKILLed when the parent dies (PR_SET_PDEATHSIG; the signal follows the parent's thread
    that forked us). False where unsupported; never raises. A parent already gone kills us at once."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True
