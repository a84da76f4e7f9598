"""The publisher bandit, content dedup and ghost evidence: unit level, no network."""

from __future__ import annotations

import random
import time

from node.learn.groups import Group, score_responses
from node.learn.tasks import PRESETS, TaskSampler
from node.swarm.bandit import BanditConfig, PublisherBandit
from node.swarm.exchange import Received
from node.swarm.verify import SignedExchange, VerifyConfig, make_batch
from p2p.identity import Identity
from p2p.wire import WIRE_VERSION, RolloutBatch, encode_signed

MIX = PRESETS["smoke"]


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def bandit(**cfg) -> PublisherBandit:
    return PublisherBandit(BanditConfig(**cfg), random.Random(0))


def test_proven_publishers_get_most_slots_and_exploration_keeps_a_bounded_share():
    b = bandit()
    proven = [key(i) for i in range(20)]
    for p in proven:
        b.observe(p, useful=True)
    sybils = [key(1000 + i) for i in range(100)]
    chosen = b.choose({p: 1 for p in proven + sybils}, 16)
    assert len(chosen) == 16
    assert sum(c in proven for c in chosen) == 12  # K - K/4
    assert sum(c in sybils for c in chosen) == 4  # exploration never starves
    # few proven publishers: every one of them, and the free slots explore
    chosen = b.choose({p: 1 for p in proven[:3] + sybils}, 16)
    assert set(proven[:3]) <= set(chosen) and len(chosen) == 16


def test_a_failed_key_is_parked_with_a_doubling_cooldown_and_never_tried_keys_go_first():
    b = bandit()
    ghost, new = key(1), key(2)
    b.observe(ghost, useful=False)
    assert not b.fresh(ghost) and b.fresh(new)
    assert b.choose({ghost: 5, new: 5}, 4) == [new]  # parked: not even in the exploration
    b.new_round()
    assert b.fresh(ghost)  # one round after one failure
    assert b.choose({ghost: 5, new: 5}, 4) == [new, ghost]
    b.observe(ghost, useful=False)
    waits = 0
    while not b.fresh(ghost):
        b.new_round()
        waits += 1
    assert waits == 2
    for _ in range(20):
        b.observe(ghost, useful=False)
    assert b.record(ghost).next_try - b.round == BanditConfig().max_cooldown


def test_one_useful_batch_promotes_and_a_run_of_failures_demotes():
    b = bandit()
    p = key(7)
    b.observe(p, useful=True)
    assert b.preferred(16) == [p] and b.fresh(p)
    for _ in range(8):
        b.observe(p, useful=False)
    assert b.preferred(16) == []  # (1+1)/(1+8+2) < 0.2


def test_newcomer_is_tried_within_unknown_over_exploration_slots_rounds():
    """The documented bound: U never-tried keys, E new-key slots per round -> tried within ceil(U / E)."""
    b = bandit()
    honest = [key(i) for i in range(3)]
    for p in honest:
        b.observe(p, useful=True)
    sybils = [key(1000 + i) for i in range(300)]
    newcomer = key(5000)
    k = 16
    for rnd in range(1, 100):
        candidates = {p: rnd for p in honest + sybils + [newcomer] if b.fresh(p)}
        chosen = b.choose(candidates, k)
        assert set(honest) <= set(chosen)
        if newcomer in chosen:
            break
        for p in chosen:
            b.observe(p, useful=p in honest)
        b.new_round()
    assert rnd <= -(-(len(sybils) + 1) // (k - len(honest) - 1)) + 1, rnd


def test_never_tried_keys_of_higher_work_tiers_are_explored_first():
    """A newcomer one work tier above 1000 never-tried Sybil keys is tried in its first round: the Sybils
    would have to be minted at its tier (16x the work each) to stand in its way."""
    b = bandit()
    honest = [key(i) for i in range(3)]
    for p in honest:
        b.observe(p, useful=True)
    sybils, newcomer, rich_sybil = [key(1000 + i) for i in range(1000)], key(5000), key(6000)
    candidates = {p: 1 for p in honest + sybils + [newcomer]}
    assert newcomer in b.choose(candidates, 16, {newcomer: 1})
    chosen = b.choose({**candidates, rich_sybil: 1}, 16, {newcomer: 1, rich_sybil: 2})
    assert chosen.index(rich_sybil) < chosen.index(newcomer)  # more work, earlier: the price of the delay
    assert sum(c in sybils for c in b.choose(candidates, 16)) >= 10  # without tiers: one of 1001


def test_the_table_is_bounded():
    b = bandit(max_tracked=50)
    for i in range(500):
        b.observe(key(i), useful=bool(i % 2))
    assert b.snapshot()["tracked"] == 50


def groups(seed: int) -> list[Group]:
    out = []
    for task in TaskSampler(MIX, seed).sample(2):
        responses = [f"<answer>{task.answer}</answer>", "<answer>nope</answer>"]
        out.append(Group(task=task, responses=responses, rewards=score_responses(task, responses)))
    return out


def exchange() -> SignedExchange:
    return SignedExchange(Identity.generate(), MIX, VerifyConfig(swarm="s"), "m")


def recopy(original: bytes, thief: Identity, round_: int) -> bytes:
    from p2p.wire import decode_signed

    b = decode_signed(original)
    return encode_signed(
        RolloutBatch(WIRE_VERSION, "s", round_, thief.public_key_bytes, time.time(), "m", b.groups), thief
    )


def test_copied_content_is_trained_on_once_and_the_copier_earns_nothing():
    ex = exchange()
    honest, thief = Identity.generate(), Identity.generate()
    original = make_batch(honest, "s", 1, "m", groups(3))
    copy = recopy(original, thief, 9)
    got = ex._verify_all([(honest.public_key_bytes, original)])
    assert len(got) == 2
    assert ex._verify_all([(thief.public_key_bytes, copy)]) == []
    assert ex.stats.rejected[thief.public_key_hex] == {"duplicate": 2}
    assert ex.reputation.score(thief.public_key_bytes) < 0 < ex.reputation.score(honest.public_key_bytes)
    assert not ex.bandit.fresh(thief.public_key_bytes) and ex.bandit.preferred(4) == [honest.public_key_bytes]


def test_within_a_round_the_proven_publisher_is_judged_before_its_copier():
    ex = exchange()
    honest, thief = Identity.generate(), Identity.generate()
    ex._verify_all([(honest.public_key_bytes, make_batch(honest, "s", 1, "m", groups(3)))])  # proven
    original = make_batch(honest, "s", 2, "m", groups(4))
    copy = recopy(original, thief, 2)
    got = ex._verify_all([(thief.public_key_bytes, copy), (honest.public_key_bytes, original)])  # copy listed first
    assert {g.source for g in got} == {honest.public_key_hex}


def test_a_ghost_is_evidence_against_its_publisher():
    ex = exchange()
    ghost = Identity.generate().public_key_bytes
    ex.bandit.missing(ghost, 3)  # the transport reports ghosts to its publisher chooser: the exchange's bandit
    assert not ex.bandit.fresh(ghost) and ex.reputation.score(ghost) < 0
    assert ex.bandit.record(ghost).next_try - ex.bandit.round == 8  # honest software never makes one
    ex.stats.new_round()
    import asyncio

    asyncio.run(ex.verify(Received()))
    assert ex.stats.round_rejected["ghost"] == 1
    for r in range(40):  # repeated, it ends in a ban through the reputation machinery
        ex.bandit.missing(ghost, 4 + r)
    assert not ex.reputation.allowed(ghost)


def test_a_copy_seen_before_its_proven_original_is_charged_to_the_copier():
    ex = exchange()
    honest, thief = Identity.generate(), Identity.generate()
    for r, seed in ((1, 3), (3, 7)):  # proven, with a history longer than one batch
        ex._verify_all([(honest.public_key_bytes, make_batch(honest, "s", r, "m", groups(seed)))])
    original = make_batch(honest, "s", 4, "m", groups(4))
    assert len(ex._verify_all([(thief.public_key_bytes, recopy(original, thief, 2))])) == 2  # first sight: used
    assert ex.bandit.record(thief.public_key_bytes).ok == 1
    before = ex.reputation.score(honest.public_key_bytes)
    assert ex._verify_all([(honest.public_key_bytes, original)]) == []  # never trained on twice
    assert ex.reputation.score(honest.public_key_bytes) > before  # its useful groups still earn it credit
    assert ex.stats.rejected[thief.public_key_hex]["duplicate"] == 2
    assert ex.stats.rejected[honest.public_key_hex] == {"copied_from": 2}  # no penalty for the original
    assert ex.bandit.record(thief.public_key_bytes).ok == 0 and not ex.bandit.fresh(thief.public_key_bytes)
    assert ex.bandit.record(honest.public_key_bytes).bad == 0  # its batch still counts as useful
    assert ex.reputation.score(thief.public_key_bytes) < ex.reputation.score(honest.public_key_bytes)


def test_a_copy_between_keys_of_equal_standing_charges_nobody():
    ex = exchange()
    c, d = Identity.generate(), Identity.generate()
    data = make_batch(c, "s", 1, "m", groups(6))
    ex._verify_all([(c.public_key_bytes, data)])  # c earns 2 x 0.1 for its two groups
    ex.reputation.credit(d.public_key_bytes)
    ex.reputation.credit(d.public_key_bytes)  # d stands where c stands: no one can tell the copier
    assert ex._verify_all([(d.public_key_bytes, recopy(data, d, 1))]) == []
    assert ex.stats.rejected[d.public_key_hex] == {"duplicate": 2}  # counted, not charged
    assert abs(ex.reputation.score(c.public_key_bytes) - ex.reputation.score(d.public_key_bytes)) < 1e-9


def test_a_newcomer_seen_once_is_queued_and_tried_within_the_bound_without_being_seen_again():
    """The bound's second half: a reader meets the newcomer once (its shard came up in the rotation) behind
    300 never-tried keys of its tier met earlier. Afterwards the reader's sample holds only what it reads
    first (the preferred shards: proven keys and the queue's head) plus a random handful, so the newcomer
    is a candidate again only because it is queued. It is tried within ceil(U / n) rounds; queued keys
    whose shards were read without them (gone) are forgotten."""
    b = bandit()
    k = 16
    honest = [key(i) for i in range(3)]
    for p in honest:
        b.observe(p, useful=True)
    sybils, newcomer, gone = [key(1000 + i) for i in range(300)], key(5000), key(6000)
    rng = random.Random(1)
    b.choose({p: 1 for p in honest + sybils + [gone]}, k)  # round 1: meets the crowd (and tries some)
    b.new_round()
    seen_once = {p: 2 for p in honest + sybils + [newcomer]}  # met once, behind the crowd
    slots = k - len(honest)
    n = slots - max(1, slots // 4)  # never-tried slots per round (PROTOCOL: the rest go to retries)
    for rnd in range(2, 100):
        head = b.preferred(k)
        assert set(honest) <= set(head) and len(head) <= k
        candidates = (
            seen_once
            if rnd == 2
            else {p: rnd for p in set(head) | set(rng.sample(sybils, 5)) if p != gone and b.fresh(p)}
        )
        chosen = b.choose(candidates, k)
        if newcomer in chosen:
            break
        for p in chosen:
            b.observe(p, useful=p in honest)
        b.new_round()
    assert rnd <= 2 + -(-len(sybils) // n), rnd
    assert b.record(gone) is None and gone not in b.preferred(k)  # read for, absent: dropped, never tried


def test_a_full_queue_keeps_the_higher_tiers_and_the_earliest():
    b = bandit(max_queued=10)
    b.choose({key(i): 1 for i in range(10)}, 1)  # ten tier-0 keys queued (one of them tried below)
    b.choose({key(100): 1, key(101): 1}, 1, {key(100): 1})  # a tier-1 key displaces the newest tier-0 key
    assert b.snapshot()["queued"] == 10
    assert b.preferred(16)[0] == key(100)
    assert key(101) not in b.preferred(16)  # a later tier-0 key does not displace earlier ones
