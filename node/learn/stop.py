"""Cooperative cancellation of a round: the model code polls a `StopRequest` at safe points.

Safe points are between generated tokens, between micro-batches and before the first optimizer step of
a round. Raising `RoundAbandoned` there unwinds the round without touching the weights or the optimizer,
so the loop can checkpoint the last *completed* round and redo the abandoned one on resume.
"""

from __future__ import annotations

import threading
from typing import Callable


class RoundAbandoned(Exception):
    """The round in progress was given up at a safe point because a stop was requested."""


class StopRequest:
    """A thread-safe flag set by a signal handler (event loop thread) and polled by the model worker."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.reason = ""

    def set(self, reason: str) -> None:
        """Request the stop (idempotent, any thread); the first reason is kept."""
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the setting thread) when the stop is requested; at once if it already is."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Called at a safe point: raises RoundAbandoned if a stop was requested (cheap otherwise)."""
        if self._event.is_set():
            raise RoundAbandoned(self.reason)
