"""Cooperative cancellation of a round: the model code polls a `StopRequest` at safe points.

Safe points are between generated tokens, between micro-batches and before the first optimizer step of
a round, and, inside a forward or backward pass, between two decoder layers (`watch`): on a loaded CPU
one forward of the default model is many seconds, so a stop does not wait for it. Raising
`RoundAbandoned` there unwinds the round without touching the weights or the optimizer, so the loop can
checkpoint the last *completed* round and redo the abandoned one on resume.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the CLIs import this module before any model work
    import torch


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

    @contextmanager
    def watch(self, model: torch.nn.Module, allowed: Callable[[], bool] = lambda: True) -> Iterator[None]:
        """While inside, every decoder layer's forward, and the backward through its output, first
        checks the request (when `allowed()`): a stop lands within one layer, not one whole pass."""
        import torch

        def check() -> None:
            if self._event.is_set() and allowed():
                raise RoundAbandoned(self.reason)

        def before_forward(_module, _args) -> None:
            check()

        def after_forward(_module, _args, output) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda _grad: check())  # runs when backward reaches this layer

        handles = []
        for layer in _layers(model):
            handles.append(layer.register_forward_pre_hook(before_forward))
            handles.append(layer.register_forward_hook(after_forward))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks: the longest ModuleList (decoder layers in every causal LM we load)."""
    import torch

    lists: list[Any] = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    sizes = [len(m) for m in lists]
    return list(lists[sizes.index(max(sizes))]) if lists else [model]  # the first of the longest


class StartupStopped(Exception):
    """A stop was requested while the node was starting (a model loading or converting): nothing to save."""


def until_stopped(stop: StopRequest, fn: Callable[..., Any], *args: Any, poll_s: float = 0.1) -> Any:
    """fn(*args) in a daemon thread, this thread waiting on it until it returns (its result, or its error) or
    `stop` is requested (StartupStopped: the thread is left to die with the process). For start-up work with
    no safe point of its own: loading a model from disk or converting it takes a minute on a slow disk, and a
    stop must not wait for it. Only for work whose half-done state nothing reads (the conversion writes
    into a temporary directory renamed at its end: node/learn/model_io.py)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    worker = threading.Thread(target=run, name="start-up", daemon=True)
    worker.start()
    while worker.is_alive():
        if stop.is_set():
            raise StartupStopped(stop.reason)
        worker.join(poll_s)  # signal handlers run in this (the main) thread meanwhile
    if "error" in box:
        raise box["error"]
    return box["result"]
