"""The loopback WAN (scripts/bench/relay.py) that the WAN end-to-end test and benchmark put peers behind: it
delays each direction by its link's latency, keeps the bytes in order, does not hold a stream to one chunk
per round trip, caps bandwidth, and cuts connections when told to. Times are asserted as lower bounds only
(what the relay adds), never as upper bounds."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from scripts.bench.relay import HOST, Link, Wan


class Echo:
    """A TCP echo server on 127.0.0.1 in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
            w.close()

        async def main() -> None:
            server = await asyncio.start_server(echo, HOST, 0)
            self.port = server.sockets[0].getsockname()[1]
            self.ready.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())


@pytest.fixture(scope="module")
def echo():
    return Echo()


async def roundtrip(port: int, payload: bytes, pieces: int = 1) -> tuple[bytes, float]:
    r, w = await asyncio.open_connection(HOST, port)
    t0 = time.perf_counter()
    step = max(1, len(payload) // pieces)
    for i in range(0, len(payload), step):
        w.write(payload[i : i + step])
    await w.drain()
    got = b""
    while len(got) < len(payload):
        data = await r.read(65536)
        assert data, "connection closed early"
        got += data
    elapsed = time.perf_counter() - t0
    w.close()
    return got, elapsed


async def test_a_relay_delays_each_way_and_keeps_the_bytes_in_order(echo):
    with Wan() as wan:
        relay = wan.add(echo.port, Link(delay_s=0.05, jitter_s=0.02))
        payload = bytes(range(256)) * 2000  # 512 KB in many chunks, each jittered: order must hold
        got, elapsed = await roundtrip(relay.listen_port, payload, pieces=64)
        assert got == payload
        assert elapsed >= 0.1  # one round trip through the relay at the least
        assert relay.stats.bytes_in == relay.stats.bytes_out == len(payload)


async def test_many_chunks_in_flight_are_not_one_round_trip_each(echo):
    """Writes in quick succession: a relay that slept in line per chunk would hold one at a time; this one holds
    several, each waiting for its own release time, so a stream is not bound to a chunk per round trip."""
    with Wan() as wan:
        relay = wan.add(echo.port, Link(delay_s=0.2))
        r, w = await asyncio.open_connection(HOST, relay.listen_port)
        for _ in range(50):
            w.write(b"x" * 1000)
            await w.drain()
            await asyncio.sleep(0.002)
        got = 0
        while got < 50_000:
            got += len(await r.read(65536))
        w.close()
        assert relay.stats.most_queued > 1


async def test_a_bandwidth_cap_and_a_cut(echo):
    with Wan() as wan:
        capped = wan.add(echo.port, Link(bandwidth_bps=1_000_000))
        got, elapsed = await roundtrip(capped.listen_port, b"y" * 300_000, pieces=30)
        assert len(got) == 300_000 and elapsed >= 0.3  # 300 KB each way at 1 MB/s per direction (overlapping)
        cutting = wan.add(echo.port, Link(cut_p=1.0))
        r, w = await asyncio.open_connection(HOST, cutting.listen_port)
        w.write(b"hello")
        await w.drain()
        assert await asyncio.wait_for(r.read(100), 10) == b""  # closed instead of echoed
        assert cutting.stats.cuts == 1
