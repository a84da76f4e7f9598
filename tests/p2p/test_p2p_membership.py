"""Staying in the swarm (p2p/membership.py) with real DHT peers on 127.0.0.1: a peer whose initial peer is down
starts solo, joins when that peer appears at its address, goes solo again when every peer has left, and
rejoins when the peer comes back. The timings are shortened (watch and backoff) so this runs in seconds."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID

from p2p.dht_process import DHTNotReading, ask, child_pids, live_peers_in_dht, takes_commands
from p2p.membership import JOINED, SOLO, Backoff, Membership, probe, tcp_target
from p2p.transport import SwarmTransport, TransportConfig, TransportError

SWARM = "tmember"
POW = 6
pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_at(tmp: Path, port: int, name: str = "boot") -> tuple[SwarmTransport, str]:
    """A DHT peer that will listen on `port` with a libp2p identity made now: its address is known before
    it runs (as a bootstrap's is, from its --identity-dir)."""
    identity = tmp / f"{name}.p2p.identity"
    if not identity.exists():
        P2P.generate_identity(str(identity))
    peer_id = PeerID.from_identity(identity.read_bytes())
    cfg = TransportConfig(
        identity_dir=tmp / name,
        swarm=SWARM,
        host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"],
        p2p_identity_file=identity,
        pow_difficulty=POW,
    )
    return SwarmTransport(cfg), f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"


def member(tmp: Path, peers: list[str], **kw) -> Membership:
    cfg = TransportConfig(
        identity_dir=tmp / "member",
        swarm=SWARM,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=peers,
        pow_difficulty=POW,
    )
    kw.setdefault("backoff", Backoff(first_s=0.2, max_s=1.0))
    return Membership(SwarmTransport(cfg), watch_every_s=0.5, probe_timeout_s=1.0, rng=random.Random(0), **kw)


async def until(pred, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.1)


def test_tcp_targets_of_multiaddrs():
    assert tcp_target("/ip4/10.0.0.1/tcp/31337/p2p/QmX") == ("10.0.0.1", 31337)
    assert tcp_target("/dns4/boot.example.org/tcp/4001") == ("boot.example.org", 4001)
    assert tcp_target("/ip6/::1/tcp/9") == ("::1", 9)
    assert tcp_target("/ip4/10.0.0.1/udp/4001/quic") is None  # only a full start can test it
    assert tcp_target("/ip4/10.0.0.1/tcp/x") is None


async def test_probe_tells_a_closed_port_from_an_open_one():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert await probe(f"/ip4/127.0.0.1/tcp/{listening.getsockname()[1]}/p2p/QmX", 2.0) is None
    assert await probe(f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/QmX", 2.0) == "connection refused"


async def test_a_name_is_resolved_and_a_slow_lookup_does_not_hold_up_the_end(monkeypatch):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert await probe(f"/dns4/localhost/tcp/{listening.getsockname()[1]}/p2p/QmX", 2.0) is None  # /etc/hosts

    def unreachable_dns_server(*_args, **_kw):  # glibc retries one for 10 s per server
        time.sleep(30)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", unreachable_dns_server)
    t0 = time.monotonic()
    said = await asyncio.get_running_loop().run_in_executor(
        None, asyncio.run, probe("/dns4/boot.example.org/tcp/31337", 0.5)
    )  # asyncio.run's end joins its default executor's threads: a lookup there kept a stop waiting 30 s
    assert said == "no answer within 0.5 s" and time.monotonic() - t0 < 5


async def test_solo_while_the_bootstrap_is_down_joined_when_it_appears_and_again_after_every_peer_left(
    tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="p2p.membership")
    port = free_port()
    boot, address = peer_at(tmp_path, port)
    m = member(tmp_path, [address])
    try:
        await m.start()
        assert m.state.state == SOLO and not m.transport.alive  # started at once, no DHT process
        said = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1 and address in said[0].message and "connection refused" in said[0].message
        assert "check that the peer at that address is running" in said[0].message
        assert m.state.to_dict()["message"].startswith("solo: waiting for peers since ")

        await boot.start()  # the bootstrap appears at the address the member was given
        await until(lambda: m.joined, 30, "the member to join")
        assert m.transport.alive and await m.transport.routing_peer_count(5.0) == 1
        assert any("joined the swarm through" in r.message for r in caplog.records)

        await boot.shutdown()  # every peer leaves: the member notices and is solo again
        await until(lambda: m.state.state == SOLO, 30, "the member to notice it is alone")
        assert any("every peer has left" in r.message for r in caplog.records)

        boot, _ = peer_at(tmp_path, port)  # the bootstrap restarts (same identity, same address)
        await boot.start()
        await until(lambda: m.joined, 30, "the member to rejoin")
        assert m.state.state == JOINED and await m.transport.routing_peer_count(5.0) == 1
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        await m.close()
        await boot.shutdown()
    assert not m.transport.alive


async def test_require_peers_keeps_the_strict_start(tmp_path):
    _, address = peer_at(tmp_path, free_port())
    m = member(tmp_path, [address], require_peers=True)
    with pytest.raises(TransportError, match="initial peers"):
        await m.start()
    assert not m.transport.alive


async def test_a_stop_during_the_first_join_returns_at_once(tmp_path):
    """An address that accepts TCP but never speaks libp2p: the probe answers and the DHT peer's start then
    waits on the handshake (up to its timeouts, tens of seconds). A stop ends the join instead, and shuts
    down the half-started DHT peer."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the kernel's backlog and are never served
        m = member(
            tmp_path,
            [f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/QmPKxbjj7f9tqZ8Mq6eLzpFzkbwkaERA87VSuqF2aPhrV4"],
        )
        stopped = asyncio.Event()
        asyncio.get_running_loop().call_later(1.0, stopped.set)
        await asyncio.wait_for(m.start(stopped), 15.0)
        assert not m.joined and m._task is None  # no background task was left behind
        assert not m.transport.alive
        await m.close()


@pytest.mark.parametrize("fill_pipe", [True, False])
async def test_a_dht_process_that_stops_reading_is_replaced_not_waited_on(tmp_path, caplog, fill_pipe):
    """A DHT process that runs but reads no command (SIGSTOP here; a stuck loop alike): hivemind's pipe takes
    ~80 commands, then a send blocks the event loop for good. The member never sends into a full pipe; with
    room left, each look times out and after `silent_after` of them in a row it stops counting on the process.
    Either way it kills it (SIGTERM does not end a stopped process) and joins again with a new one."""
    caplog.set_level(logging.INFO, logger="p2p.membership")
    boot, address = peer_at(tmp_path, free_port())
    await boot.start()
    m = member(tmp_path, [address], silent_after=3)
    try:
        await m.start()
        assert m.joined
        stuck = m.transport.dht
        p2pd = child_pids(stuck.pid)
        os.kill(stuck.pid, signal.SIGSTOP)
        sent = 0
        while fill_pipe and takes_commands(stuck):  # select's "writable": a command fits without blocking
            stuck.run_coroutine(live_peers_in_dht, return_future=True)
            sent += 1
            assert sent < 10_000
        if fill_pipe:
            assert sent > 10 and not m.transport.alive  # a full pipe: the transport sends no more
            with pytest.raises(DHTNotReading):
                await ask(stuck, live_peers_in_dht, 1.0)
        await until(lambda: m.state.state == SOLO, 30, "the member to give up on its DHT process")
        if not fill_pipe:
            assert any("answered none of the last 3 looks" in r.message for r in caplog.records)
        await until(lambda: m.joined, 30, "the member to join again with a new DHT process")
        assert not stuck.is_alive() and m.transport.dht is not stuck
        assert await m.transport.routing_peer_count(5.0) == 1
        await until(lambda: not any(Path(f"/proc/{p}").exists() for p in p2pd), 10, "the old p2pd to end")
    finally:
        await m.close()
        await boot.shutdown()
