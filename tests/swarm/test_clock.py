"""Whose clock a batch from the future blames (node/swarm/clock.py): the rules one at a time."""

from __future__ import annotations

import asyncio
import logging
import time

from node.swarm.clock import MIN_DHT_PEERS, OLD_S, QUORUM, RECENT, SAY_EVERY_S, UNHEARD_FETCHES, ClockCheck
from p2p.identity import Identity
from p2p.transport import SwarmTransport, TransportConfig
from p2p.wire import WIRE_VERSION, RolloutBatch, TaskSpecWire, WireGroup, encode_signed

SKEW = 120.0
AHEAD = 300.0  # a batch this far ahead of our clock: past the skew


def keys(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def test_the_majority_must_be_strict_and_of_at_least_a_quorum():
    check = ClockCheck(SKEW)
    a, b, c, d = keys(4)
    assert check.judge(a, 1, AHEAD) == "from_future"  # one publisher: too few to blame our clock
    assert check.judge(b, 1, AHEAD) == "from_future"  # two: still fewer than QUORUM = 3
    assert QUORUM == 3 and check.judge(c, 1, AHEAD) == "clock_behind"
    assert check.judge(d, 1, 0.0) is None  # 3 of 4 ahead: still most
    check.judge(c, 2, 0.0)  # c's newest batch is dated now: 2 of 4 ahead is not most
    assert check.judge(a, 2, AHEAD) == "from_future"


def test_a_replayed_older_batch_does_not_move_its_publishers_offset():
    check = ClockCheck(SKEW)
    a, b, c = keys(3)
    for k in (a, b):
        check.judge(k, 5, AHEAD)
    check.judge(c, 5, 0.0)
    assert check.judge(c, 3, -500.0) is None  # c's round 3 again, old: c's newest (round 5) still counts
    assert check.newest[c] == (5, 0.0)
    assert check.judge(a, 6, AHEAD) == "clock_behind"  # 2 of 3 ahead


def test_only_the_recent_publishers_are_remembered():
    check = ClockCheck(SKEW)
    for k in keys(RECENT + 8):
        check.judge(k, 1, 0.0)
    assert len(check.newest) == RECENT and keys(1)[0] not in check.newest  # the least recently seen went first


def test_the_ahead_hint_needs_a_quorum_and_repeats_only_after_a_while(caplog):
    now = [0.0]
    check = ClockCheck(SKEW, clock=lambda: now[0])
    a, b, c = keys(3)
    with caplog.at_level(logging.WARNING, logger="sapo.swarm"):
        check.judge(a, 1, -OLD_S - 100)
        check.judge(b, 1, -OLD_S - 100)
        assert not caplog.records  # two publishers: no hint
        check.judge(c, 1, -OLD_S - 100)
        check.judge(c, 2, -OLD_S - 100)
        assert len(caplog.records) == 1 and "this clock is ahead" in caplog.records[0].getMessage()
        now[0] += SAY_EVERY_S
        check.judge(c, 3, -OLD_S - 100)
        assert len(caplog.records) == 2  # said again while it holds, at most every SAY_EVERY_S


def test_the_behind_message_gives_no_number_to_set_the_clock_by(caplog):
    check = ClockCheck(SKEW)
    with caplog.at_level(logging.WARNING, logger="sapo.swarm"):
        for k in keys(3):
            check.judge(k, 1, 12345.0)  # identities can date their batches as they like
    (message,) = [r.getMessage() for r in caplog.records]
    assert "12345" not in message and "(2 of 3)" not in message and "(3 of 3)" in message and "NTP" in message


def test_presence_records_mostly_far_off_are_said(caplog):
    check = ClockCheck(SKEW)
    with caplog.at_level(logging.WARNING, logger="sapo.swarm"):
        check.presence(read=2, off_clock=2, lifetime_s=600)  # fewer than a quorum
        check.presence(read=4, off_clock=2, lifetime_s=600)  # half: not most
        assert not caplog.records
        check.presence(read=3, off_clock=2, lifetime_s=600)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "2 of 3 peers" in message and "more than 600 s away" in message and "none of their batches" in message


def unheard_fetches(check: ClockCheck, n: int, dht_peers: int | None = 3, answered: int = 64, read: int = 0) -> None:
    for _ in range(n):
        check.unheard(dht_peers, answered, read, "myswarm", 600.0)


def test_reading_no_peer_for_many_completed_fetches_is_said_once_in_a_while(caplog):
    now = [0.0]
    check = ClockCheck(SKEW, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="sapo.swarm"):
        unheard_fetches(check, UNHEARD_FETCHES - 1)
        assert not caplog.records
        unheard_fetches(check, 1)
        (message,) = [r.getMessage() for r in caplog.records]
        assert f"{UNHEARD_FETCHES} fetches in a row" in message and "swarm 'myswarm'" in message
        assert "another --swarm" in message and "ahead by more than 600 s" in message and "NTP" in message
        unheard_fetches(check, 5)
        assert len(caplog.records) == 1  # at most every SAY_EVERY_S while it holds
        now[0] += SAY_EVERY_S
        unheard_fetches(check, 1)
        assert len(caplog.records) == 2


def test_what_is_no_evidence_of_an_unheard_swarm(caplog):
    check = ClockCheck(SKEW)
    with caplog.at_level(logging.WARNING, logger="sapo.swarm"):
        # a lone node beside its bootstrap (which publishes no presence): nothing to hear, no hint
        unheard_fetches(check, 3 * UNHEARD_FETCHES, dht_peers=MIN_DHT_PEERS - 1)
        unheard_fetches(check, 3 * UNHEARD_FETCHES, dht_peers=None)  # routing table not read
        unheard_fetches(check, UNHEARD_FETCHES - 1)
        unheard_fetches(check, 3 * UNHEARD_FETCHES, answered=0)  # every search timed out (a loaded machine)
        assert check.unheard_fetches == UNHEARD_FETCHES - 1  # ... counts neither way
        unheard_fetches(check, 1, read=1)  # a peer was read: start over
        unheard_fetches(check, UNHEARD_FETCHES - 1)
        assert not caplog.records


async def test_a_node_of_another_swarm_on_the_same_dht_reads_no_peer_and_says_so(tmp_path, caplog):
    """Real DHT peers on loopback: two of swarm "ttest" and one of "another" (a typo in --swarm) joined through
    the first. The stray one's fetch completes and reads no presence, while its routing table holds both:
    what `unheard` is fed each round. A clock ahead by more than the records' lifetime looks the same."""

    def cfg(name: str, swarm: str, peers: list[str]) -> TransportConfig:
        return TransportConfig(
            identity_dir=tmp_path / name, swarm=swarm, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers,
            pow_difficulty=6, fetch_timeout_s=30.0,
        )  # fmt: skip

    a = SwarmTransport(cfg("a", "ttest", []))
    await a.start()
    b, stray = (
        SwarmTransport(cfg("b", "ttest", a.visible_maddrs())),
        SwarmTransport(cfg("stray", "another", a.visible_maddrs())),
    )
    await asyncio.gather(b.start(), stray.start())
    try:
        for t in (a, b, stray):
            group = WireGroup(TaskSpecWire("basic_arithmetic", {}, 5, 1), ["x", "y"], [1.0, 0.0])
            ident: Identity = t.identity
            data = RolloutBatch(WIRE_VERSION, t.config.swarm, 1, ident.public_key_bytes, time.time(), "m", [group])
            # the stray's records are refused by the others' validators: only its own result is not asserted
            published = await t.publish(1, encode_signed(data, ident))
            assert published or t is stray
        assert [r.publisher for r in await b.fetch()] == [a.identity.public_key_bytes]  # the swarm works
        assert await stray.fetch() == []
        fetched = stray.last_fetch
        peers = await stray.routing_peer_count(10.0)
        assert fetched.shards_answered > 0 and not fetched.presence_keys and peers is not None and peers >= 2
        check = ClockCheck(SKEW)
        with caplog.at_level(logging.WARNING, logger="sapo.swarm"):
            for _ in range(UNHEARD_FETCHES):
                check.unheard(peers, fetched.shards_answered, len(fetched.presence_keys), "another", 600.0)
        assert "read no presence record of swarm 'another'" in caplog.text
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown(), stray.shutdown())
