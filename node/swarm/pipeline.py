"""The network off the round's critical path (`NetPipeline`): a round hands its batch to a background publisher,
and trains on external groups that a background prefetch fetched and verified while the round generated.

Per round r (node/loop.py `run_round`): `prefetch(r)` at the round's start begins fetching and verifying
others' batches (one prefetch at a time: while one runs, none starts); `publish(r, groups)` hands our batch to
the publisher task, which publishes one batch at a time, the newest waiting one first (a batch still waiting
when a newer one comes is superseded: readers read a publisher's announced round only); `take(r)` at select
time gives the groups of the prefetch that has finished, without waiting, or none while it still runs.

The staleness bound: a prefetch begun at round r0 is taken at round r0 + `max_age` (--net-max-age) at the
latest: at that round the round waits for it (bounded by --net-timeout, ended by a stop), so a node runs at
most `max_age` rounds ahead of its network. A group trained on at round r was fetched by a prefetch begun at
a round in [r - max_age, r], from a batch its publisher signed at most the records' lifetime (600 s, checked
by the Verifier) before, the newest round its publisher had announced then.

In line (`--net-pipeline off`, and `auto` for a silo and the in-process swarms of experiments, whose runs must
stay reproducible): publish, fetch and verify are awaited in the round, each bounded by --net-timeout.

The guarantees of the in-line path hold, through the same exchange calls: one verification at a time (the
exchange's verification thread, off the event loop), each batch judged once and no group trained on twice
(the verifier's judged set and contents; `NodeTotals.fresh` across restarts), owner protection and
reputation. A prefetched batch that is never trained on (a stop, an abandoned round) is dropped: the network's
state is not part of what an abandoned round rewinds, in line or not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from node.learn.groups import Group
from node.learn.stop import StopRequest
from node.swarm.exchange import Exchange, RoundCounts

log = logging.getLogger("sapo.node")


@dataclass
class Arrival:
    """What a round takes from the network: verified external groups, and the counters of the verification that
    judged them (the round that trains on them records them)."""

    groups: list[Group] = field(default_factory=list)
    counts: RoundCounts = field(default_factory=RoundCounts)
    fetch_round: int | None = None  # our round at whose start its fetch began (None: nothing arrived)
    seconds: float | None = None  # what its fetch and verification took, waited for or not
    waited: bool = False  # the round waited for it: in line, or at the staleness bound


Phase = Callable[[str], AbstractContextManager]  # node/ops/live.py's PhaseTimer: `with phase("fetch"):`


class NetPipeline:
    """One node's publisher and prefetch tasks, or the in-line path (`background` False)."""

    def __init__(self, exchange: Exchange, stop: StopRequest, net_timeout: float, background: bool, max_age: int):
        self.exchange = exchange
        self.stop = stop
        self.net_timeout = net_timeout
        self.background = background
        self.max_age = max_age
        self._stop_event: asyncio.Event | None = None  # wakes a round's waits on a stop (SapoNode.run)
        self._prefetch: asyncio.Task[Arrival] | None = None
        self._prefetch_round = 0
        self._prefetch_began = 0.0
        self._publisher: asyncio.Task[None] | None = None
        self._to_publish: tuple[int, list[Group]] | None = None
        self.publishing: int | None = None  # the round whose batch is being published now

    def start(self, stop_event: asyncio.Event) -> None:
        self._stop_event = stop_event

    # --- the round's calls, in its order ------------------------------------------------------------------

    def prefetch(self, r: int) -> None:
        """Begin fetching and verifying others' batches for this round or a later one, unless a prefetch runs."""
        if not self.background or self._prefetch is not None:
            return
        self._prefetch_round, self._prefetch_began = r, time.monotonic()
        self._prefetch = asyncio.ensure_future(self._fetch_and_verify(r))

    async def publish(self, r: int, groups: list[Group]) -> None:
        """Our batch of round r: to the publisher task (returns at once), or published now in line."""
        if not self.background:
            await self._in_round(self.exchange.publish(r, groups), "publish")
            return
        self._to_publish = (r, groups)  # supersedes a batch still waiting
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.ensure_future(self._publish_newest())

    async def take(self, r: int, phase: Phase) -> Arrival:
        """The verified groups this round may train on: the finished prefetch's, at once; at the staleness bound
        the round waits for a running one; in line, fetched and verified now (`phase` times each step)."""
        if not self.background:
            began = time.monotonic()
            with phase("fetch"):
                received = await self._in_round(self.exchange.fetch(r), "fetch")
            with phase("verify"):  # a fetch that failed or timed out leaves nothing to verify
                groups = await self._in_round(self.exchange.verify(received), "verify") if received else None
            counts = self.exchange.stats.round_counts() if received else RoundCounts()
            return _arrived(groups or [], counts, r, time.monotonic() - began, waited=True)
        with phase("fetch"):
            task = self._prefetch
            if task is None:
                return Arrival()
            waited = not task.done() and r - self._prefetch_round >= self.max_age
            if waited:  # the bound: this round waits (a stop ends the wait and abandons the round)
                await _wait(task, self.net_timeout, self._stop_event)
                self.stop.check()
            if not task.done():
                if waited:
                    log.warning("the prefetch of round %d is still running; going on without it", self._prefetch_round)
                return Arrival()
            self._prefetch = None
            try:
                arrival = task.result()
            except Exception as exc:  # a bug in the background: this round goes on without the swarm
                log.warning("the prefetch of round %d failed: %s", self._prefetch_round, exc)
                return Arrival()
            arrival.waited = waited
            if r - self._prefetch_round > self.max_age:  # it outran a bounded wait: past the bound, dropped
                log.warning("round %d: %d groups of round %d too old", r, len(arrival.groups), arrival.fetch_round)
                arrival.groups = []
            return arrival

    def state(self) -> dict[str, Any]:
        """What the network is doing behind the rounds (/status)."""
        task = self._prefetch
        ready = task is not None and task.done() and not task.cancelled() and task.exception() is None
        return {
            "pipeline": self.background,
            "max_age": self.max_age,
            "prefetch_round": self._prefetch_round if task is not None else None,
            "prefetch_running_s": round(time.monotonic() - self._prefetch_began, 3) if task and not ready else None,
            "groups_waiting": len(task.result().groups) if task is not None and ready else 0,
            "publishing": self.publishing,
            "publish_waiting": self._to_publish[0] if self._to_publish else None,
        }

    async def close(self) -> None:
        """Cancel the background tasks (a stop: nothing waits for the network)."""
        tasks = [t for t in (self._prefetch, self._publisher) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._prefetch = self._publisher = None

    # --- in the background --------------------------------------------------------------------------------

    async def _fetch_and_verify(self, r: int) -> Arrival:
        began = time.monotonic()
        received = await self._bounded(self.exchange.fetch(r), "fetch")
        groups = await self._bounded(self.exchange.verify(received), "verify") if received is not None else None
        counts = self.exchange.stats.round_counts() if received is not None else RoundCounts()
        return _arrived(groups or [], counts, r, time.monotonic() - began, waited=False)

    async def _publish_newest(self) -> None:
        while self._to_publish is not None:
            (r, groups), self._to_publish = self._to_publish, None
            self.publishing = r
            try:
                await self._bounded(self.exchange.publish(r, groups), "publish")
            finally:
                self.publishing = None

    def _bounded(self, coro: Coroutine[Any, Any, Any], what: str) -> Coroutine[Any, Any, Any]:
        """A background call: bounded by --net-timeout, cancelled with its task (close); no stop check."""
        return within_net_timeout(coro, what, self.net_timeout)

    def _in_round(self, coro: Coroutine[Any, Any, Any], what: str) -> Coroutine[Any, Any, Any]:
        return within_net_timeout(coro, what, self.net_timeout, self.stop, self._stop_event)


def _arrived(groups: list[Group], counts: RoundCounts, r: int, seconds: float, waited: bool) -> Arrival:
    for g in groups:
        g.fetch_round = r
    return Arrival(groups, counts, r, seconds, waited)


async def _wait(task: asyncio.Future, timeout: float, stop_event: asyncio.Event | None) -> None:
    """Until `task` is done, `timeout` passes or `stop_event` is set; `task` goes on in any case."""
    stopped = asyncio.ensure_future(stop_event.wait()) if stop_event else None
    try:
        await asyncio.wait([t for t in (task, stopped) if t], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stopped is not None:
            stopped.cancel()


def _ignore_outcome(task: asyncio.Future) -> None:
    """A network call given up on (timeout or stop): fetch its outcome so asyncio does not warn about it."""
    if not task.cancelled():
        task.exception()


async def within_net_timeout(
    coro, what: str, timeout: float, stop: StopRequest | None = None, stop_event: asyncio.Event | None = None
):
    """A round never waits on the network longer than --net-timeout, nor after a stop request (`stop_event`
    wakes the wait; `stop.check()` then abandons the round). A failure or a timeout is logged and gives None:
    the swarm must never crash the node. Cancelled, the call is cancelled too."""
    task = asyncio.ensure_future(coro)
    try:
        await _wait(task, timeout, stop_event)
    finally:
        if not task.done():  # timed out, stopped or cancelled: the call is given up on
            task.cancel()
            task.add_done_callback(_ignore_outcome)
    if not task.done():
        if stop is not None:
            stop.check()
        log.warning("%s took longer than --net-timeout %.1fs; going on without it", what, timeout)
        return None
    try:
        return task.result()
    except Exception as exc:
        log.warning("%s failed: %s", what, exc)
    return None


def pipelined(mode: str, in_process: bool) -> bool:
    """--net-pipeline: `auto` is on over a network, off for a silo and in-process swarms (reproducible runs)."""
    return mode == "on" or (mode == "auto" and not in_process)
