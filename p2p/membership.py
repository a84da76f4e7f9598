"""Staying in the swarm: the first join, retries while no initial peer answers, a rejoin when every peer left.

A node that can train alone never waits for the swarm (the paper: "nodes can operate in silo if desired"),
so joining is not a condition of starting. `Membership.start` tries once; when no initial peer answers it
says so in one line (which address, what failed, what to check) and the node starts its rounds solo. A
background task then probes the initial peers with backoff (a TCP connect: cheap, no process started)
and starts the DHT peer once one answers; the node shares from its next round on. The same task watches
a joined peer's routing table: empty at `alone_after` looks in a row means every peer has left (or the
DHT process died), and the peer is solo again and rejoins the same way. Its DHT stays up meanwhile, so
peers that know its address can still reach it (which makes it joined again). A DHT process that runs but
answers no look for `silent_after` looks in a row (stopped, or its loop stuck) is shut down, and the peer
rejoins with a new one: its commands would otherwise pile up until sending one blocks the event loop.

Nothing here blocks the event loop and every wait has a timeout. With `require_peers` the first join is
today's strict one: no answer is an error (`TransportError`), for operators who want the node to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from p2p.transport import SwarmTransport, TransportError

logger = logging.getLogger(__name__)

JOINED, SOLO, STARTING = "joined", "solo", "starting"
# A failed start that retrying cannot fix: this machine's own address or files, not the peers'
LOCAL_FAILURES = (
    "address already in use",
    "cannot assign requested address",
    "failed to listen",
    "already taken by another peer",
)
CHECK = (
    "check that the peer at that address is running and reachable from here (address, port, firewall) and "
    "that --peers names its current address"
)


@dataclass(frozen=True)
class Backoff:
    """Seconds between join attempts: first_s, doubling up to max_s, each +-jitter (peers started together
    do not probe together)."""

    first_s: float = 1.0
    max_s: float = 30.0  # a probe is one TCP connect: cheap enough to keep the wait for a swarm short
    jitter: float = 0.1

    def delay(self, tries: int, rng: random.Random) -> float:
        base = min(self.max_s, self.first_s * 2.0 ** max(0, tries))
        return base * (1.0 + self.jitter * (2.0 * rng.random() - 1.0))


@dataclass
class MembershipState:
    """Where a peer stands, for status, metrics and the dashboard."""

    state: str = STARTING
    since: float = field(default_factory=time.time)  # when this state began (Unix time)
    tries: int = 0  # join attempts since the peer went solo
    last_error: str = ""
    next_try_at: float | None = None  # Unix time of the next attempt (solo)

    def message(self) -> str:
        if self.state == SOLO:
            return f"solo: waiting for peers since {clock_time(self.since)}"
        return self.state

    def to_dict(self) -> dict:
        out: dict = {"state": self.state, "since": self.since, "message": self.message()}
        if self.state == SOLO:
            out.update(tries=self.tries, last_error=self.last_error, next_try_at=self.next_try_at)
        return out


def clock_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def tcp_target(maddr: str) -> tuple[str, int] | None:
    """(host, port) of a /ip4, /ip6 or /dns multiaddr over TCP; None for other transports (QUIC, relays)."""
    parts = maddr.strip("/").split("/")
    pairs = dict(zip(parts[0::2], parts[1::2]))
    host = next((pairs[k] for k in ("ip4", "ip6", "dns", "dns4", "dns6") if k in pairs), None)
    if host is None or "tcp" not in pairs or "p2p-circuit" in parts:
        return None
    try:
        return host, int(pairs["tcp"])
    except ValueError:
        return None


PROBE_TIMEOUT_S = 3.0  # a TCP connect to an initial peer


async def resolve(host: str, port: int) -> str:
    """An address of `host` (itself when it is one). The lookup runs in a daemon thread of its own: asyncio's
    runs in the default executor, whose threads the end of `asyncio.run` joins with no timeout, so a stop
    while an unreachable DNS server was being asked waited for the resolver's retries (tens of seconds)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str] = loop.create_future()

    def settle(fn: Callable[..., None], value: object) -> None:
        if not answer.done():
            fn(value)

    def look_up() -> None:
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            result: tuple[Callable[..., None], object] = (answer.set_result, str(info[0][4][0]))
        except (OSError, IndexError) as e:
            result = (answer.set_exception, e if isinstance(e, OSError) else OSError(f"no address for {host}"))
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, *result)

    threading.Thread(target=look_up, name=f"resolve {host}", daemon=True).start()
    return await answer


async def probe(maddr: str, timeout: float) -> str | None:
    """None when a TCP connection to the peer's address opens within `timeout` (or when the address is not
    one a TCP connect can test), else what went wrong, in a few words."""
    target = tcp_target(maddr)
    if target is None:
        return None

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(await resolve(*target), target[1])

    try:
        _, writer = await asyncio.wait_for(connect(), timeout)
    except asyncio.TimeoutError:
        return f"no answer within {timeout:g} s"
    except socket.gaierror as e:
        return f"cannot resolve {target[0]} ({e.strerror})"
    except OSError as e:  # asyncio's message names the address again: the errno's says it all
        return os.strerror(e.errno).lower() if e.errno else str(e) or type(e).__name__
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    return None


async def none_answer(peers: list[str], timeout: float) -> str | None:
    """When none of `peers` answers a TCP probe within `timeout`: what went wrong with each; None if one does."""
    answers = await asyncio.gather(*(probe(m, timeout) for m in peers))
    return "; ".join(f"{m}: {why}" for m, why in zip(peers, answers)) if all(answers) else None


def no_peer_answered(why: str) -> str:
    """The one wording of a strict start (`--require-peers`) that no initial peer answered, with `none_answer`'s
    reasons: the library's error and the command line's early probe say it alike."""
    return f"none of the initial peers answered ({why})"


class Membership:
    """Keeps `transport` in its swarm (module docstring). `joined` and `state` are read by the exchange."""

    def __init__(
        self,
        transport: SwarmTransport,
        require_peers: bool = False,
        backoff: Backoff = Backoff(),
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        watch_every_s: float = 10.0,
        alone_after: int = 2,
        silent_after: int = 6,
        remind_every_s: float = 600.0,
        rng: random.Random | None = None,
    ):
        self.transport = transport
        self.require_peers = require_peers
        self.backoff, self.probe_timeout_s, self.watch_every_s = backoff, probe_timeout_s, watch_every_s
        self.alone_after, self.silent_after, self.remind_every_s = alone_after, silent_after, remind_every_s
        self.rng = rng or random.Random()
        self.state = MembershipState()
        self._task: asyncio.Task | None = None
        self._empty_looks = self._silent_looks = 0
        self._reminded_at = 0.0
        self.peer_count: int | None = None  # live peers in the routing table at the last look (None: no answer)

    @property
    def peers(self) -> list[str]:
        return list(self.transport.config.initial_peers)

    @property
    def joined(self) -> bool:
        return self.state.state == JOINED

    async def start(self, stopped: asyncio.Event | None = None) -> None:
        """The first join, then the background task. Returns at once when `stopped` is set (a stop during
        start-up: the half-started DHT peer is shut down). TransportError when the node should exit: no
        answer with require_peers, a start that failed on this machine's side, or no DHT without peers."""
        first = asyncio.ensure_future(self._first_join())
        waits = [first] + ([asyncio.ensure_future(stopped.wait())] if stopped is not None else [])
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits[1:]:
                w.cancel()
        if not first.done():
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
            logger.info("stop requested while joining the swarm: not joining")
            return
        first.result()  # TransportError goes on up
        self._task = asyncio.ensure_future(self._keep_joined())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.transport.shutdown()

    async def _first_join(self) -> None:
        if not self.peers:  # the first peer of a swarm: up, and solo until a peer joins it
            await self.transport.start()
            self._set(SOLO, error="no peer has joined yet")
            logger.info("first peer of swarm %r: waiting for peers to join", self.transport.config.swarm)
            return
        if self.require_peers:  # strict: no answer is an error, as before this module
            why = await none_answer(self.peers, self.probe_timeout_s)
            if why is not None:  # said in a probe's time, not after the DHT's own bootstrap timeouts
                raise TransportError(no_peer_answered(why))
            await self.transport.start()
            self._set(JOINED)
            return
        error = await self._try_join()
        if error is None:
            self._set(JOINED)
            return
        self._set(SOLO, error=error)
        logger.warning(
            "no initial peer answered (%s): training in silo and retrying in the background; %s "
            "(or pass --require-peers to exit instead)",
            error,
            CHECK,
        )

    async def _try_join(self) -> str | None:
        """Probe the initial peers; if one answers, (re)start the DHT peer through them. None once joined,
        else what failed. A failure on this machine's side raises TransportError (retrying cannot fix it)."""
        why = await none_answer(self.peers, self.probe_timeout_s)
        if why is not None:
            return why
        await self.transport.shutdown()  # a DHT left alone by every peer: restarted through the initial peers
        try:
            await self.transport.start()
        except TransportError as e:
            if any(s in str(e).lower() for s in LOCAL_FAILURES):
                raise
            return str(e)
        return None

    async def _keep_joined(self) -> None:
        """The background task: watch while joined, retry while solo. Never raises (a bug is logged)."""
        while True:
            try:
                if self.joined:
                    await asyncio.sleep(self.watch_every_s)
                    await self._watch()
                else:
                    await self._retry()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep training; the next look tries again
                logger.warning("swarm membership check failed: %s: %s", type(e).__name__, e)
                logger.debug("membership check traceback", exc_info=True)
                await asyncio.sleep(self.watch_every_s)

    async def _watch(self) -> None:
        if not self.transport.alive:
            self._empty_looks = self.alone_after
            reason = "the DHT process has stopped (or stopped reading its commands)"
        else:
            peers = self.peer_count = await self.transport.routing_peer_count(self.watch_every_s / 2)
            self._silent_looks = self._silent_looks + 1 if peers is None else 0
            if peers is None and self._silent_looks < self.silent_after:  # no answer in time: no evidence yet
                return
            if peers is None:
                self._empty_looks = self.alone_after
                reason = f"the DHT process answered none of the last {self.silent_after} looks"
                await self.transport.shutdown()  # a new one is started on the way back, as for a dead one
            else:
                self._empty_looks = self._empty_looks + 1 if peers == 0 else 0
                reason = "every peer has left (empty routing table)"
        if self._empty_looks < self.alone_after:
            return
        self._empty_looks = self._silent_looks = 0
        self._set(SOLO, error=reason, since=time.time() - self.watch_every_s * (self.alone_after - 1))
        how = "rejoining through --peers in the background" if self.peers else "waiting for peers to join"
        logger.warning("%s: training in silo, %s", reason, how)

    async def _retry(self) -> None:
        """One attempt after the backoff's delay; joined again when it works, or when a peer reached us."""
        st = self.state
        delay = self.backoff.delay(st.tries, self.rng)
        st.next_try_at = time.time() + delay
        await asyncio.sleep(delay)
        st.tries += 1
        if self.transport.alive and await self.transport.routing_peer_count(self.probe_timeout_s):
            self._joined_again(": a peer reached this one")
            return
        if not self.peers:
            error = None if self.transport.alive else await self._restart_alone()
            if error:
                st.last_error = error
            return
        error = await self._try_join()
        if error is None:
            self._joined_again(f" through {', '.join(self.peers)}")
            return
        st.last_error = error
        logger.debug("join attempt %d failed: %s", st.tries, error)
        if time.time() - self._reminded_at >= self.remind_every_s:
            self._reminded_at = time.time()
            logger.info("still %s (%d tries; last: %s)", st.message(), st.tries, error)

    async def _restart_alone(self) -> str | None:
        """A first peer (no --peers) whose DHT process stopped: start it again, alone (a process that runs but
        stopped reading its commands is shut down first)."""
        await self.transport.shutdown()
        try:
            await self.transport.start()
        except TransportError as e:
            return str(e)
        return None

    def _joined_again(self, how: str) -> None:
        st = self.state
        logger.info(
            "joined the swarm%s (solo since %s, %d tries): sharing from the next round",
            how,
            clock_time(st.since),
            st.tries,
        )
        self._set(JOINED)

    def _set(self, state: str, error: str = "", since: float | None = None) -> None:
        self.state = MembershipState(state=state, since=time.time() if since is None else since, last_error=error)
        self._reminded_at = time.time()


def on_stop_event(set_stop: Callable[[Callable[[], None]], None]) -> asyncio.Event:
    """An event of the running loop that `set_stop`'s callback sets from any thread (a signal handler's):
    `set_stop` registers the callback (node.learn.stop.StopRequest.on_set). A late callback, after the loop
    is gone, does nothing."""
    loop, event = asyncio.get_running_loop(), asyncio.Event()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(event.set)

    set_stop(wake)
    return event
