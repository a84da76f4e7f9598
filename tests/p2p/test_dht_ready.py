"""Waiting for a DHT process to start: bounded, and a stop during the wait is noticed (unit, fake DHT)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from p2p.dht_process import wait_ready, wait_ready_blocking


class SlowDHT:
    """hivemind.DHT's wait_until_ready: blocks up to `timeout`, TimeoutError until it has started."""

    def __init__(self, ready_after_s: float) -> None:
        self.ready_at = time.monotonic() + ready_after_s

    def wait_until_ready(self, timeout: float) -> None:
        left = self.ready_at - time.monotonic()
        if left > timeout:
            time.sleep(timeout)
            raise TimeoutError
        time.sleep(max(0.0, left))


def test_blocking_wait_returns_once_started():
    assert wait_ready_blocking(SlowDHT(0.3), timeout=5.0, stop=threading.Event(), poll_s=0.05) is True


def test_blocking_wait_gives_up_at_its_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not start within 1 s"):
        wait_ready_blocking(SlowDHT(60.0), timeout=0.6, stop=threading.Event(), poll_s=0.05)
    assert time.monotonic() - t0 < 3.0


def test_blocking_wait_notices_a_stop_at_once():
    # the bootstrap's Ctrl-C during a slow start-up: not ignored for the whole --start-timeout
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    assert wait_ready_blocking(SlowDHT(60.0), timeout=60.0, stop=stop, poll_s=0.1) is False
    assert time.monotonic() - t0 < 2.0


def test_async_wait_is_bounded_and_cancellable():
    async def scenario() -> float:
        await wait_ready(SlowDHT(0.2), timeout=5.0, poll_s=0.05)
        with pytest.raises(TimeoutError):
            await wait_ready(SlowDHT(60.0), timeout=0.5, poll_s=0.05)
        task = asyncio.create_task(wait_ready(SlowDHT(60.0), timeout=60.0, poll_s=0.05))
        await asyncio.sleep(0.2)
        task.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 1.0
