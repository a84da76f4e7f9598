"""Per-publisher reputation: scoring, bans with backoff and expiry, bounded table, persistence, and the
verifier's use of it (bans skip verification, only signed offences count, per-round budgets)."""

import json
import logging
import time
from hashlib import sha256

import pytest

from node.learn.groups import Group, score_responses
from node.learn.tasks import PRESETS, TaskSampler
from node.swarm.exchange import ExchangeStats, Received
from node.swarm.reputation import PENALTIES, REPUTATION_FILE, Reputation, ReputationConfig
from node.swarm.verify import SignedExchange, Verifier, VerifyConfig, make_batch
from p2p.identity import Identity
from p2p.presence import FetchStats
from p2p.wire import WIRE_VERSION, RolloutBatch, TaskSpecWire, WireCaps, WireGroup, encode_signed

MIX = PRESETS["cpu-easy"]


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


# ---------------------------------------------------------------- scoring


def test_two_severe_offences_ban_a_newcomer_and_unattributable_ones_change_nothing():
    rep = Reputation(clock=Clock())
    for reason in ("bad_signature", "malformed", "oversize", "stale", "stale_round", "wrong_swarm", "version"):
        rep.penalize(key(1), reason)  # anyone can cause these under someone else's key: no effect
    assert rep.score(key(1)) == 0 and rep.allowed(key(1))
    rep.penalize(key(1), "reward_mismatch")
    assert rep.allowed(key(1)) and rep.score(key(1)) == -PENALTIES["reward_mismatch"]
    rep.penalize(key(1), "reward_mismatch")
    assert not rep.allowed(key(1)) and rep.banned_count() == 1
    assert rep.allowed(key(2))  # nobody else


def test_credit_is_slow_and_capped_so_history_buys_no_immunity():
    cfg = ReputationConfig()
    rep = Reputation(cfg, clock=Clock())
    for _ in range(10_000):
        rep.credit(key(1))
    assert rep.score(key(1)) == cfg.max_score
    rep.penalize(key(1), "reward_mismatch")
    rep.penalize(key(1), "reward_mismatch")
    assert rep.allowed(key(1))  # a long good history absorbs two severe offences
    rep.penalize(key(1), "reward_mismatch")
    assert not rep.allowed(key(1))  # not three


def test_useless_groups_decay_mildly_and_honest_signal_keeps_a_peer_afloat():
    rep = Reputation(clock=Clock())
    for i in range(600):  # one group in five with learning signal, as a weak honest model
        rep.credit(key(1)) if i % 5 == 0 else rep.penalize(key(1), "useless")
        rep.penalize(key(2), "useless")  # never any signal: a flood of valid but useless groups
    assert rep.score(key(1)) > 0 and rep.allowed(key(1))
    assert not rep.allowed(key(2))


# ---------------------------------------------------------------- bans: duration, expiry, backoff


def test_ban_expires_into_probation_and_repeat_offences_back_off_exponentially():
    clock = Clock()
    cfg = ReputationConfig(ban_s=100.0, max_ban_s=350.0)
    rep = Reputation(cfg, clock=clock)

    def ban() -> float:
        start = clock.t
        while rep.allowed(key(1)):
            rep.penalize(key(1), "reward_mismatch")
        snap = rep.snapshot()["peers"][key(1).hex()]
        return snap["banned_until"] - start

    durations = []
    for _ in range(4):
        durations.append(ban())
        clock.t += durations[-1] - 1
        assert not rep.allowed(key(1))
        clock.t += 1
        assert rep.allowed(key(1))  # expired
        assert rep.score(key(1)) == cfg.probation_score
    assert durations == [100.0, 200.0, 350.0, 350.0]  # doubling, capped
    # on probation one more severe offence is enough
    rep.penalize(key(1), "reward_mismatch")
    assert not rep.allowed(key(1))


def test_offences_during_a_ban_do_not_extend_it():
    clock = Clock()
    rep = Reputation(ReputationConfig(ban_s=100.0), clock=clock)
    rep.penalize(key(1), "reward_mismatch")
    rep.penalize(key(1), "reward_mismatch")
    until = rep.snapshot()["peers"][key(1).hex()]["banned_until"]
    for _ in range(50):
        rep.penalize(key(1), "schema")
    assert rep.snapshot()["peers"][key(1).hex()]["banned_until"] == until


# ---------------------------------------------------------------- bounded table


def test_table_is_bounded_and_evicts_oldest_neutral_entries_first():
    clock = Clock()
    rep = Reputation(ReputationConfig(max_tracked=100, ban_s=1e6), clock=clock)
    rep.penalize(key(0), "reward_mismatch")
    rep.penalize(key(0), "reward_mismatch")  # banned
    clock.t += 1
    for _ in range(30):
        rep.credit(key(1))  # trusted
    for i in range(2, 5000):
        clock.t += 1
        rep.penalize(key(i), "useless")  # a Sybil flood of new keys, each nearly neutral
        assert len(rep) <= 100
    assert not rep.allowed(key(0)), "a ban survives the flood"
    assert rep.score(key(1)) > 0, "a trusted peer survives the flood"
    assert rep.score(key(4999)) < 0, "the newest entries are kept"
    assert rep.score(key(2)) == 0, "the oldest neutral entries went first"


def test_a_table_full_of_bans_still_tracks_and_bans_a_new_offender():
    clock = Clock()
    rep = Reputation(ReputationConfig(max_tracked=50, ban_s=1e6), clock=clock)
    for i in range(50):
        clock.t += 1
        rep.penalize(key(i), "reward_mismatch")
        rep.penalize(key(i), "reward_mismatch")
    assert rep.banned_count() == 50
    clock.t += 1
    rep.penalize(key(999), "reward_mismatch")
    rep.penalize(key(999), "reward_mismatch")
    assert not rep.allowed(key(999)) and len(rep) <= 50
    assert rep.allowed(key(0)), "the ban that ends soonest made room"


def test_snapshot_is_bounded_and_lists_bans_and_the_best():
    rep = Reputation(clock=Clock())
    for i in range(50):
        rep.penalize(key(i), "reward_mismatch")
        rep.penalize(key(i), "reward_mismatch")
    for i in range(100, 150):
        rep.credit(key(i))
    snap = rep.snapshot(top=5)
    assert snap["tracked"] == 100 and snap["banned"] == 50
    assert len(snap["peers"]) == 10
    assert sum(1 for p in snap["peers"].values() if p["banned_until"]) == 5
    json.dumps(snap)


# ---------------------------------------------------------------- persistence


def test_save_and_load_round_trip(tmp_path):
    clock = Clock()
    rep = Reputation(ReputationConfig(ban_s=500.0), clock=clock)
    rep.penalize(key(1), "reward_mismatch")
    rep.penalize(key(1), "reward_mismatch")
    rep.credit(key(2))
    path = tmp_path / REPUTATION_FILE
    assert rep.save(path)
    assert [p.name for p in tmp_path.iterdir()] == [REPUTATION_FILE]  # no temp file left behind
    again = Reputation(ReputationConfig(ban_s=500.0), clock=clock)
    assert again.load(path)
    assert not again.allowed(key(1)) and again.score(key(2)) == pytest.approx(0.1)
    assert again.snapshot() == rep.snapshot()
    clock.t += 501
    assert again.allowed(key(1))  # the ban's end is wall-clock time, kept in the file


def test_empty_table_writes_no_file_and_missing_file_is_a_fresh_table(tmp_path):
    rep = Reputation()
    assert not rep.save(tmp_path / REPUTATION_FILE)
    assert not (tmp_path / REPUTATION_FILE).exists()
    assert not rep.load(tmp_path / REPUTATION_FILE) and len(rep) == 0


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b"[]",
        json.dumps({"format": "other", "peers": {}}).encode(),
        json.dumps({"format": "sapo-reputation/1", "peers": {"zz": {}}}).encode(),
        json.dumps(
            {
                "format": "sapo-reputation/1",
                "peers": {"ab": {"score": "x", "banned_until": 0, "strikes": 0, "last_seen": 0}},
            }
        ).encode(),
        b'{"format": "sapo-reputation/1", "peers": {"ab": {"score": NaN, "banned_until": 0, "strikes": 0, '
        b'"last_seen": 0}}}',
        json.dumps(
            {
                "format": "sapo-reputation/1",
                "peers": {"ab": {"score": 1, "banned_until": 0, "strikes": -1, "last_seen": 0}},
            }
        ).encode(),
    ],
)
def test_corrupt_file_gives_one_warning_and_a_fresh_table(tmp_path, caplog, content):
    path = tmp_path / REPUTATION_FILE
    path.write_bytes(content)
    rep = Reputation()
    rep.penalize(key(7), "reward_mismatch")  # whatever was there before loading is replaced
    with caplog.at_level(logging.WARNING, logger="sapo.swarm"):
        assert not rep.load(path)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "corrupt" in warnings[0].getMessage()
    assert len(rep) == 1  # a failed load keeps the table it had (fresh at start)
    assert (tmp_path / (REPUTATION_FILE + ".corrupt")).read_bytes() == content  # kept for a look
    path.write_bytes(b"corrupt again")
    assert not Reputation().load(path)  # a second corrupt file is kept beside the first, not over it
    assert (tmp_path / (REPUTATION_FILE + ".corrupt")).read_bytes() == content
    assert (tmp_path / (REPUTATION_FILE + ".corrupt.1")).read_bytes() == b"corrupt again"
    rep.penalize(key(8), "schema")
    assert rep.save(path) and Reputation().load(path)  # and the next save writes a good file


def _row(score="1", strikes="0") -> bytes:
    return (
        b'{"format": "sapo-reputation/1", "peers": {"ab": {"score": '
        + score.encode()
        + b', "banned_until": 0, "strikes": '
        + strikes.encode()
        + b', "last_seen": 0}}}'
    )


@pytest.mark.parametrize(
    "content",
    [
        _row(strikes="Infinity"),  # json reads it; int() of it is an OverflowError, not a ValueError
        _row(strikes="1e999"),
        _row(score="1" + "0" * 400),  # an int no float holds
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the json module recurses
    ],
    ids=["strikes-Infinity", "strikes-1e999", "score-10^400", "deep"],
)
def test_numbers_no_type_holds_and_deep_nesting_are_corrupt_not_a_crash(tmp_path, caplog, content):
    """Reputation.load never raises on the file's content: these too are one warning and a fresh table."""
    path = tmp_path / REPUTATION_FILE
    path.write_bytes(content)
    rep = Reputation()
    with caplog.at_level(logging.WARNING, logger="sapo.swarm"):
        assert not rep.load(path)
    assert len(rep) == 0 and any("corrupt" in r.getMessage() for r in caplog.records)
    assert (tmp_path / (REPUTATION_FILE + ".corrupt")).read_bytes() == content


# ---------------------------------------------------------------- the verifier uses it


def groups(seed=1, n=2, signal=True):
    out = []
    for task in TaskSampler(MIX, seed).sample(n):
        responses = ([f"<answer>{task.answer}</answer>"] if signal else []) + [
            "<answer>nope</answer>",
            "<answer>0</answer>",
        ]
        out.append(Group(task=task, responses=responses, rewards=score_responses(task, responses)))
    return out


def lying(peer: Identity, round_: int) -> bytes:
    gs = groups(seed=round_)
    for g in gs:
        g.rewards = [r + 1.0 for r in g.rewards]
    return make_batch(peer, "s", round_, "m", gs)


def test_verifier_bans_a_liar_and_then_skips_it_unopened(monkeypatch):
    stats = ExchangeStats()
    v = Verifier(Identity.generate().public_key_bytes, MIX, VerifyConfig(swarm="s"), stats)
    liar, honest = Identity.generate(), Identity.generate()
    assert v.verify(lying(liar, 1), hint=liar.public_key_bytes) == []
    assert stats.rejected[liar.public_key_hex]["reward_mismatch"] == 2
    assert not v.reputation.allowed(liar.public_key_bytes)

    opened = []
    monkeypatch.setattr("node.swarm.verify.decode_signed", lambda *a, **k: opened.append(1))
    data = lying(liar, 2)
    assert v.verify(data, hint=liar.public_key_bytes) == []
    assert v.verify(data, hint=liar.public_key_bytes) == []  # refetched: counted once
    assert stats.rejected[liar.public_key_hex]["banned"] == 1 and not opened
    monkeypatch.undo()
    assert len(v.verify(make_batch(honest, "s", 1, "m", groups()), hint=honest.public_key_bytes)) == 2
    assert v.reputation.score(honest.public_key_bytes) > 0


def test_garbage_under_someone_elses_key_cannot_frame_it():
    stats = ExchangeStats()
    v = Verifier(Identity.generate().public_key_bytes, MIX, VerifyConfig(swarm="s"), stats)
    victim = Identity.generate()
    for i in range(50):
        data = bytearray(make_batch(victim, "s", i, "m", groups()))
        at = data.find(b"nope")
        data[at : at + 4] = b"yes!"  # the victim's key in the header, a signature that does not hold
        v.verify(bytes(data), hint=victim.public_key_bytes)
        v.verify(make_batch(Identity.generate(), "s", i, "m", groups()), hint=victim.public_key_bytes)
    assert stats.rejected[victim.public_key_hex]["bad_signature"] == 50
    assert v.reputation.score(victim.public_key_bytes) == 0 and v.reputation.allowed(victim.public_key_bytes)


def test_signed_cap_violations_cost_the_signer():
    stats = ExchangeStats()
    v = Verifier(Identity.generate().public_key_bytes, MIX, VerifyConfig(swarm="s", caps=WireCaps(max_groups=1)), stats)
    peer = Identity.generate()
    v.verify(make_batch(peer, "s", 1, "m", groups(n=2)), hint=None)  # no transport hint: the signer is read
    assert stats.rejected[peer.public_key_hex]["too_many_groups"] == 1
    assert v.reputation.score(peer.public_key_bytes) == -PENALTIES["too_many_groups"]


def test_a_signed_config_nested_too_deep_to_re_encode_costs_the_signer():
    """Not a decoder failure of ours ("malformed", nobody charged): signed content no honest node writes."""
    import orjson

    from p2p.wire import HEADER_LEN, canonical_json, seal

    stats = ExchangeStats()
    v = Verifier(Identity.generate().public_key_bytes, MIX, VerifyConfig(swarm="s"), stats)
    peer = Identity.generate()
    obj = orjson.loads(make_batch(peer, "s", 1, "m", groups())[HEADER_LEN:])
    obj["groups"][0]["task"]["config"] = {"k": [[[[]]]]}
    payload = canonical_json(obj).replace(b"[[[[]]]]", b"[" * 300 + b"]" * 300)
    assert v.verify(seal(payload, peer), hint=peer.public_key_bytes) == []
    assert stats.rejected[peer.public_key_hex] == {"schema": 1}
    assert v.reputation.score(peer.public_key_bytes) == -PENALTIES["schema"]


async def test_publisher_chooser_skips_banned_publishers_and_counts_them_once_per_round():
    ex = exchange()
    liar, honest = Identity.generate(), Identity.generate()
    ex.bandit.observe(liar.public_key_bytes, useful=True)  # proven before it lied
    assert ex.bandit.preferred(16) == [liar.public_key_bytes]
    ex.reputation.penalize(liar.public_key_bytes, "reward_mismatch")
    ex.reputation.penalize(liar.public_key_bytes, "reward_mismatch")
    assert ex.bandit.preferred(16) == []  # banned: its presence shard is no longer read first
    for _ in range(3):  # the transport may ask several times while it samples candidates
        assert not ex.bandit.allowed(liar.public_key_bytes)
        assert ex.bandit.allowed(honest.public_key_bytes)
    await ex.verify(Received())
    assert ex.stats.round_rejected == {"banned": 1} and ex.stats.rejected[liar.public_key_hex]["banned"] == 1
    await ex.verify(Received())
    assert not ex.stats.round_rejected


# ---------------------------------------------------------------- per-round budgets


class Tick:
    """A clock that advances one second each time it is read: the budget counts records, not wall time."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def useless_batch(peer: Identity, round_: int = 1, n_groups: int = 8) -> bytes:
    task = TaskSampler(MIX, round_).sample(1)[0]
    completions = ["<answer>nope</answer>", "<answer>nope</answer>"]  # valid, honestly scored, no signal
    wg = WireGroup(TaskSpecWire(**task.spec.to_wire()), completions, score_responses(task, completions))
    batch = RolloutBatch(
        version=WIRE_VERSION,
        swarm="s",
        round=round_,
        publisher=peer.public_key_bytes,
        created_at=time.time(),
        model="sybil",
        groups=[wg] * n_groups,
    )
    return encode_signed(batch, peer)


def exchange(**cfg) -> SignedExchange:
    return SignedExchange(Identity.generate(), MIX, VerifyConfig(swarm="s", **cfg), "m")


def test_time_budget_holds_under_a_flood_and_established_peers_go_first():
    ex = exchange(budget_s=5.0)
    honest = [Identity.generate() for _ in range(2)]
    for i, peer in enumerate(honest):  # useful before: trusted (honest peers' seeds differ: distinct content)
        ex._verify_all([(peer.public_key_bytes, make_batch(peer, "s", 1, "m", groups(seed=3 + 10 * i)))])
    sybils = [Identity.generate() for _ in range(200)]
    records = [(p.public_key_bytes, useless_batch(p)) for p in sybils]
    records[50:50] = [
        (p.public_key_bytes, make_batch(p, "s", 2, "m", groups(seed=4 + 10 * i))) for i, p in enumerate(honest)
    ]
    ex.clock = Tick()
    ex.stats.new_round()
    got = ex._verify_all(records)
    assert ex.stats.round_verified == 4  # read at 1 (start), then 2..5 before each record: 4 records
    assert ex.stats.round_rejected["over_budget"] == len(records) - 4
    assert {g.source for g in got} >= {p.public_key_hex for p in honest}, "the flood did not crowd them out"
    # what was left over gets its chance next round, and is never judged twice (a clock that stands still:
    # on a loaded machine 200 verifications can take longer than the budget, which is not under test here)
    ex.clock = lambda: 0.0
    ex.stats.new_round()
    ex._verify_all(records)
    assert ex.stats.round_verified == len(records) - 4 and not ex.stats.round_rejected["over_budget"]


def test_a_batch_still_being_judged_at_the_time_limit_is_cut_short():
    """A record begun within the time budget but slow to judge (a batch of many costly groups) stops at twice
    the budget: the groups judged keep their verdicts, the rest count over_budget and are not charged."""
    ex = exchange(budget_s=1.5)
    peer = Identity.generate()
    ex.verifier.clock = Tick()  # one second per group judged
    ex.stats.new_round()
    got = ex._verify_all([(peer.public_key_bytes, make_batch(peer, "s", 1, "m", groups(seed=5, n=4)))])
    assert len(got) == 2  # the limit is set at 1 + 2 x 1.5: judged at 2 and 3, cut at 4 and 5
    assert ex.stats.round_rejected["over_budget"] == 2
    assert ex.reputation.score(peer.public_key_bytes) > 0, "cut groups cost the publisher nothing"


def test_one_verification_at_a_time_even_after_a_round_gave_up_on_one():
    """A round that stops waiting for its verification (the net timeout) leaves it running; the next round's
    starts only once it has finished, so two never share the verifier's state."""
    import asyncio
    import threading

    ex = exchange()
    running, overlaps, order = [], [], []
    lock = threading.Lock()

    def slow(records):
        with lock:
            overlaps.append(len(running))
            running.append(1)
        time.sleep(0.3)
        order.append(records[0][1])
        with lock:
            running.pop()
        return []

    ex._verify_all = slow

    async def rounds():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ex.verify(Received([(None, b"first")])), timeout=0.05)
        await ex.verify(Received([(None, b"second")]))

    asyncio.run(rounds())
    assert order == [b"first", b"second"] and overlaps == [0, 0]
    ex.close_verification()


def test_byte_budget_holds_and_the_order_among_newcomers_is_a_seeded_shuffle():
    records = [(p.public_key_bytes, useless_batch(p)) for p in (Identity.generate() for _ in range(60))]
    size = len(records[0][1])
    verified_sets = []
    for seed in (1, 1, 2):
        ex = exchange(budget_bytes=10 * size - size // 2, budget_s=1e9, seed=seed)
        ex.stats.new_round()
        got = ex._verify_all(records)
        assert ex.stats.round_verified == 10 and ex.stats.round_verify_bytes < 11 * size
        assert ex.stats.round_rejected["over_budget"] == 50
        judged = ex.verifier.judged
        assert sorted(ex.unjudged) == [i for i, r in enumerate(records) if sha256(r[1]).hexdigest() not in judged]
        verified_sets.append({g.source for g in got})
        positions = [[r[0].hex() for r in records].index(g.source) for g in got]
        assert positions == sorted(positions), "groups come back in the order they were fetched"
    assert verified_sets[0] == verified_sets[1] != verified_sets[2]
    assert verified_sets[0] != {r[0].hex() for r in records[:10]}, "not simply the first ones fetched"


def test_flood_of_useless_batches_gets_its_publishers_banned():
    ex = exchange()
    sybil = Identity.generate()
    for r in range(1, 30):
        ex._verify_all([(sybil.public_key_bytes, useless_batch(sybil, r, n_groups=64))])
        if not ex.reputation.allowed(sybil.public_key_bytes):
            break
    assert not ex.reputation.allowed(sybil.public_key_bytes)
    assert r > 5, "useless is a mild offence: it takes many batches"


def test_per_peer_counters_stay_bounded_under_a_flood_of_new_keys():
    from node.swarm.exchange import MAX_PEERS, OTHERS

    stats = ExchangeStats()
    for i in range(3 * MAX_PEERS):
        stats.reject(key(i).hex(), "over_budget")
        stats.accept(key(i).hex())
        stats.saw(key(i).hex(), {"last_round": 1})
    stats.reject("dht", "dht_envelope_bad_signature")
    assert len(stats.rejected) == MAX_PEERS + 2 and len(stats.accepted) == MAX_PEERS + 1
    assert len(stats.peers) == MAX_PEERS
    assert stats.rejected[OTHERS]["over_budget"] == 2 * MAX_PEERS and stats.accepted[OTHERS] == 2 * MAX_PEERS
    assert stats.rejected["dht"]["dht_envelope_bad_signature"] == 1
    assert stats.round_accepted == 3 * MAX_PEERS  # totals stay exact
    stats.accept(key(0).hex())
    assert stats.accepted[key(0).hex()] == 2  # an early peer keeps its own row


class ListedTransport:
    """What DhtExchange.collect needs of a transport: the fetch returns fixed records (its FetchStats empty);
    fetch_again is recorded."""

    def __init__(self, identity: Identity, records):
        self.identity, self.records, self.offered_again = identity, records, []
        self.config = type("Cfg", (), {"fetch_timeout_s": 1.0, "record_ttl_s": 600.0})()
        self.last_fetch = FetchStats()

    async def fetch(self, max_bytes=None, chooser=None):
        return list(self.records)

    async def validator_rejections(self, timeout):
        return {}

    def fetch_again(self, records):
        self.offered_again.extend(records)


async def test_batches_over_the_verify_budget_are_offered_again_over_the_dht_not_lost():
    from node.swarm.dht_exchange import DhtExchange
    from p2p.transport import FetchedRecord

    peers = [Identity.generate() for _ in range(6)]
    records = [FetchedRecord(p.public_key_bytes, 1, useless_batch(p)) for p in peers]
    transport = ListedTransport(Identity.generate(), records)
    # sizes differ by a few bytes (created_at's digits): any two records reach the budget, no single one does
    ex = DhtExchange(
        transport, MIX, VerifyConfig(swarm="s", budget_bytes=2 * min(len(r.data) for r in records), budget_s=1e9), "m"
    )
    await ex.verify(await ex.fetch(1))
    assert ex.stats.round_verified == 2 and ex.stats.round_rejected["over_budget"] == 4
    assert transport.offered_again == [r for r in records if sha256(r.data).hexdigest() not in ex.verifier.judged]
