"""Whose clock a batch from the future blames (node/swarm/clock.py): the rules one at a time."""

from __future__ import annotations

import logging

from node.swarm.clock import OLD_S, QUORUM, RECENT, SAY_EVERY_S, ClockCheck

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
