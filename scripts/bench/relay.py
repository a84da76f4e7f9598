"""A wide-area network on loopback, for the suite and the benchmarks (this kernel has no netem): TCP relays on
127.0.0.1 that delay, jitter, stall, cut and rate-limit what passes through them.

A peer listens on 127.0.0.1:P and announces 127.0.0.1:R (hivemind's `host_maddrs` / `announce_maddrs`), where
its relay forwards to P: whoever dials the peer, the bootstrap peer included, goes through its relay, so a
connection carries the link of the peer that was dialled (a libp2p connection is kept and used both ways).
Peers of one swarm may have different links.

Delay is not a sleep in line: each direction of a connection reads on, stamps every chunk with its release
time (arrival + delay + jitter, never before the chunk ahead of it, so the byte order holds) and a writer
sends each chunk at its time. So throughput is not bound by one round trip per chunk, as it is not on a real
long link. A bandwidth cap is per peer and direction (all its connections share it: an access link).
Loss is emulated as TCP shows it to an application: a stall (a retransmission holds up the chunk and every
one behind it) or, rarely, a connection cut. Nothing here ever connects anywhere but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from dataclasses import dataclass, field

HOST = "127.0.0.1"  # the only address a relay listens on or connects to
CHUNK = 64 * 1024
QUEUED_CHUNKS = 256  # per direction of a connection: a reader that runs this far ahead waits (a TCP window)


@dataclass(frozen=True)
class Link:
    """One peer's access link, the same in each direction."""

    delay_s: float = 0.0  # one way: a round trip through the relay adds twice this
    jitter_s: float = 0.0  # uniform in [0, jitter_s], added per chunk (the order of bytes is kept)
    stall_p: float = 0.0  # per chunk: a lost segment, retransmitted after stall_s
    stall_s: float = 0.2
    cut_p: float = 0.0  # per chunk: the connection is cut (both ends closed)
    bandwidth_bps: float = 0.0  # bytes per second, per direction, shared by the peer's connections (0 = no cap)

    @property
    def rtt_s(self) -> float:
        return 2 * self.delay_s

    def __str__(self) -> str:
        parts = [f"RTT {self.rtt_s * 1e3:.0f} ms"]
        if self.jitter_s:
            parts.append(f"jitter {self.jitter_s * 1e3:.0f} ms")
        if self.stall_p:
            parts.append(f"loss {self.stall_p:.1%}")
        if self.cut_p:
            parts.append(f"cuts {self.cut_p:.2%}")
        if self.bandwidth_bps:
            parts.append(f"{self.bandwidth_bps * 8 / 1e6:.1f} Mbit/s")
        return ", ".join(parts)


@dataclass
class RelayStats:
    connections: int = 0
    cuts: int = 0
    stalls: int = 0
    bytes_in: int = 0  # towards the peer
    bytes_out: int = 0  # from the peer
    most_queued: int = 0  # chunks of one direction held at once, each waiting for its release time


@dataclass
class _Direction:
    """One direction of a peer's link: when its bandwidth is next free (shared by its connections)."""

    next_free: float = 0.0


@dataclass
class Relay:
    """127.0.0.1:listen_port -> 127.0.0.1:target_port over `link`."""

    target_port: int
    link: Link
    seed: int = 0
    stats: RelayStats = field(default_factory=RelayStats)
    listen_port: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._inbound, self._outbound = _Direction(), _Direction()
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, HOST, self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self.listen_port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self.stats.connections += 1
        try:
            peer_r, peer_w = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            client_w.close()
            self._conns.discard(task)
            return
        cut = asyncio.Event()
        pumps = [
            asyncio.ensure_future(self._pump(client_r, peer_w, self._inbound, cut, inbound=True)),
            asyncio.ensure_future(self._pump(peer_r, client_w, self._outbound, cut, inbound=False)),
        ]
        cutter = asyncio.ensure_future(cut.wait())
        try:
            # both directions to their end (a half-close is passed on), or a cut ends both at once
            both = asyncio.gather(*pumps, return_exceptions=True)
            await asyncio.wait([both, cutter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (*pumps, cutter):
                t.cancel()
            for w in (client_w, peer_w):
                w.close()
            self._conns.discard(task)

    def _release_at(self, now: float, size: int, way: _Direction, last: float) -> float:
        link, at = self.link, now + self.link.delay_s
        if link.jitter_s:
            at += self.rng.uniform(0.0, link.jitter_s)
        if link.stall_p and self.rng.random() < link.stall_p:
            self.stats.stalls += 1
            at += link.stall_s
        if link.bandwidth_bps:  # serialised on the peer's link: it leaves once the bytes ahead of it have
            way.next_free = max(now, way.next_free) + size / link.bandwidth_bps
            at = max(at, way.next_free + link.delay_s)
        return max(at, last)  # never before the chunk ahead of it

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        way: _Direction,
        cut: asyncio.Event,
        inbound: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUED_CHUNKS)

        async def send() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                if (wait := at - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.ensure_future(send())
        last = 0.0
        try:
            while data := await reader.read(CHUNK):
                if self.link.cut_p and self.rng.random() < self.link.cut_p:
                    self.stats.cuts += 1
                    cut.set()
                    return
                if inbound:
                    self.stats.bytes_in += len(data)
                else:
                    self.stats.bytes_out += len(data)
                last = self._release_at(loop.time(), len(data), way, last)
                await queue.put((last, data))
                self.stats.most_queued = max(self.stats.most_queued, queue.qsize())
            await queue.put(None)
            await sender
        except (ConnectionError, OSError):
            cut.set()
        finally:
            sender.cancel()


class Wan:
    """Relays run by an event loop of their own, in a thread: tests and benchmarks that wait in blocking calls
    (polling run dirs) keep every relay moving. Use as a context manager; `relayed` gives a peer its addresses."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.relays: list[Relay] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wan-relays", daemon=True)

    def __enter__(self) -> Wan:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, target_port: int, link: Link) -> Relay:
        """A relay to 127.0.0.1:target_port, listening on a free port of its own."""
        relay = Relay(target_port, link, seed=self.seed + len(self.relays))
        asyncio.run_coroutine_threadsafe(relay.start(), self._loop).result(10)
        self.relays.append(relay)
        return relay

    def relayed(self, link: Link) -> tuple[str, str, Relay]:
        """(host multiaddr, announce multiaddr, relay) for a peer behind `link`: it listens on a free port and
        announces its relay's."""
        port = free_port()
        relay = self.add(port, link)
        return f"/ip4/{HOST}/tcp/{port}", f"/ip4/{HOST}/tcp/{relay.listen_port}", relay

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_close_all(self.relays), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


async def _close_all(relays: list[Relay]) -> None:
    await asyncio.gather(*(r.close() for r in relays), return_exceptions=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]
