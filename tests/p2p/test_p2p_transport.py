"""Real hivemind DHT peers on 127.0.0.1: publish/fetch across peers, and owner protection."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p.dht_process import store_from_file
from p2p.identity import Identity
from p2p.pow import MAX_TIER
from p2p.presence import TIER_SCAN_ROUNDS, FetchStats, PresenceSampler, UniformChooser
from p2p.transport import SwarmTransport, TransportConfig, TransportError
from p2p.validators import (
    RECORD_SIG_MAGIC,
    SapoRecordValidator,
    batch_key,
    key_id_bytes,
    owner_subkey,
    presence_key,
    record_message,
    tier_shards,
)
from p2p.wire import (
    WIRE_VERSION,
    PresenceRecord,
    RolloutBatch,
    TaskSpecWire,
    WireGroup,
    decode_signed,
    encode_presence,
    encode_signed,
)

SWARM = "ttest"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
REPO = Path(__file__).resolve().parents[2]
POW = 6  # the proof of work itself is tested in tests/p2p/test_p2p_pow.py and tests/swarm/test_swarm_hostile.py
pytestmark = pytest.mark.timeout(90)


def config(tmp: Path, name: str, peers: list[str] | None = None, **kw) -> TransportConfig:
    """Tests compare fetched records with exact sets: a fetch returns what it has at its timeout, so the
    timeout is one no loaded machine reaches on loopback (a test of the timeout itself sets its own)."""
    kw.setdefault("pow_difficulty", POW)
    kw.setdefault("fetch_timeout_s", 30.0)
    return TransportConfig(identity_dir=tmp / name, swarm=SWARM, host_maddrs=LOOPBACK, initial_peers=peers or [], **kw)


def batch(ident: Identity, rnd: int, text: str = "answer") -> bytes:
    group = WireGroup(TaskSpecWire("basic_arithmetic", {"max_terms": 3}, 5, rnd), [text, text + "!"], [1.0, 0.0])
    return encode_signed(
        RolloutBatch(WIRE_VERSION, SWARM, rnd, ident.public_key_bytes, time.time(), "m", [group]), ident
    )


async def started(cfg: TransportConfig) -> SwarmTransport:
    t = SwarmTransport(cfg)
    await t.start()
    return t


def seen(records) -> set[tuple[bytes, int]]:
    return {(r.publisher, r.round) for r in records}


class Refusing(UniformChooser):
    """A publisher chooser that skips one publisher (as the node's skips a banned one)."""

    def __init__(self, refused: bytes):
        self.refused = refused

    def allowed(self, publisher: bytes) -> bool:
        return publisher != self.refused


async def test_three_peers_publish_and_fetch(tmp_path):
    a = await started(config(tmp_path, "a"))
    b, c = await asyncio.gather(
        started(config(tmp_path, "b", a.visible_maddrs())), started(config(tmp_path, "c", a.visible_maddrs()))
    )
    try:
        # rounds are not synchronized: every peer is at a different round
        for r in (1, 2, 3):
            assert await a.publish(r, batch(a.identity, r))
        assert await b.publish(10, batch(b.identity, 10))
        assert await c.publish(0, batch(c.identity, 0))
        ka, kb, kc = (t.identity.public_key_bytes for t in (a, b, c))

        got_c = await c.fetch()
        assert seen(got_c) == {(ka, 3), (kb, 10)}  # each publisher's newest announced round
        for rec in got_c:
            assert decode_signed(rec.data).round == rec.round
        # the policy's veto: a refused publisher is no candidate (and its batch is still there for later)
        assert seen(await a.fetch(chooser=Refusing(kb))) == {(kc, 0)}
        assert seen(await a.fetch()) == {(kb, 10)}
        assert c.known_peers() == {ka.hex(): 3, kb.hex(): 10}
        assert await c.fetch() == []  # nothing new: a batch is fetched once
        c.fetch_again([r for r in got_c if r.publisher == kb])  # unless its reader could not judge it
        assert seen(await c.fetch()) == {(kb, 10)}
        assert await a.publish(4, batch(a.identity, 4))
        assert seen(await c.fetch()) == {(ka, 4)}
        assert c.last_fetch.batches_requested == 1
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown(), c.shutdown())


async def test_a_refusing_peer_among_the_replicas_does_not_stop_the_announcements(tmp_path):
    """hivemind reports the answer of the replica that answered last. A peer of another swarm on the same DHT
    refuses our records (its validator: "payload is for another swarm"); when its refusal came last, the
    publisher took its batch for unstored and never announced it, though the other peers held it (3 runs in 3
    here). A refusal is now read back: every round's batch is stored and reaches a reader of the swarm."""
    a = await started(config(tmp_path, "a"))
    stray_cfg = TransportConfig(
        identity_dir=tmp_path / "stray", swarm="another", host_maddrs=LOOPBACK, initial_peers=a.visible_maddrs(),
        pow_difficulty=POW,
    )  # fmt: skip
    b, stray = await asyncio.gather(started(config(tmp_path, "b", a.visible_maddrs())), started(stray_cfg))
    try:
        ka = a.identity.public_key_bytes
        for r in range(1, 5):
            assert await a.publish(r, batch(a.identity, r))  # hivemind's answer may be the stray's refusal
            assert seen(await b.fetch()) == {(ka, r)}
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown(), stray.shutdown())


async def test_large_batch_round_trip(tmp_path):
    """Values over 16 KiB used to kill hivemind's DHT process (pipe EAGAIN); a batch near the cap must work."""
    a = await started(config(tmp_path, "a"))
    b = await started(config(tmp_path, "b", a.visible_maddrs()))
    try:
        groups = [WireGroup(TaskSpecWire("bf", {}, 1, i), ["x" * 1400] * 8, [0.0] * 8) for i in range(64)]
        big = RolloutBatch(WIRE_VERSION, SWARM, 3, a.identity.public_key_bytes, time.time(), "m", groups)
        data = encode_signed(big, a.identity)
        assert 700_000 < len(data) <= a.config.caps.max_batch_bytes
        assert await a.publish(3, data)
        got = {r.round: r.data for r in await b.fetch()}
        assert got[3] == data and decode_signed(got[3]) == big
        assert await a.publish(4, batch(a.identity, 4))  # the DHT process is still alive
        assert {r.round for r in await b.fetch()} == {4}
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown())


async def test_lonely_peer_and_tiny_timeouts_never_raise(tmp_path):
    a = await started(config(tmp_path, "a", fetch_timeout_s=0.0))
    try:
        assert await a.fetch() == []
        assert await a.publish(0, batch(a.identity, 0))  # stored locally
        assert await a.fetch() == []  # own records are never returned
    finally:
        await a.shutdown()
    # without a DHT peer (shut down, or being restarted by p2p.membership) nothing is sent and nothing raises
    assert await a.fetch() == [] and not await a.publish(1, batch(a.identity, 1)) and not a.alive


_GIVE_UP_PY = """
import asyncio, sys
from pathlib import Path
from p2p.dht_process import ask
from p2p.transport import SwarmTransport, TransportConfig

async def slow(_dht, _node):
    await asyncio.sleep(0.5)
    return 1

async def main():
    t = SwarmTransport(TransportConfig(identity_dir=Path(sys.argv[1]), swarm="x", pow_difficulty=4,
                                       host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    await t.start()
    try:
        await ask(t.dht, slow, 0.05)
    except asyncio.TimeoutError:
        print("TIMEOUT", flush=True)
    await asyncio.sleep(1.5)  # the call has finished in the DHT process by now
    print("ANSWER", await ask(t.dht, slow, 10.0), flush=True)  # and the DHT process still answers
    await t.shutdown()

asyncio.run(main())
"""


def test_a_dht_call_given_up_on_prints_no_traceback(tmp_path):
    """Under churn, DHT gets time out; the call goes on in the DHT process, and its late result must not end
    as two tracebacks on the node's console (it did while the timed-out future was cancelled). A process of
    its own: the DHT process writes to the console it inherited, which pytest's capture does not see."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", _GIVE_UP_PY, str(tmp_path / "id")], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0 and "TIMEOUT" in out.stdout and "ANSWER 1" in out.stdout, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "InvalidStateError" not in out.stderr, out.stderr


async def test_a_store_given_up_on_first_is_no_error(tmp_path):
    """A stop (or the publish timeout) removes the spilled batch while its store waits in the DHT process's
    queue: the store then finds no file, and says so with False, not with a traceback on the console."""
    assert await store_from_file(None, None, key="k", subkey=b"s", path=str(tmp_path / "gone"), expiration=0) is False


async def test_identity_persists_across_restarts(tmp_path):
    cfg = config(tmp_path, "a")
    a = await started(cfg)
    key, peer = a.identity.public_key_bytes, a.visible_maddrs()[0].split("/p2p/")[1]
    await a.shutdown()
    b = await started(config(tmp_path, "a", create_identity=False))
    try:
        assert b.identity.public_key_bytes == key
        assert b.visible_maddrs()[0].split("/p2p/")[1] == peer
    finally:
        await b.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_initial_peer_is_a_clear_error(tmp_path):
    ghost = await started(config(tmp_path, "ghost"))
    peer_id = ghost.visible_maddrs()[0].split("/p2p/")[1]
    await ghost.shutdown()
    dead = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{peer_id}"
    with pytest.raises(TransportError, match="initial peers"):
        await started(config(tmp_path, "x", [dead]))


class EvilValidator(RecordValidatorBase):
    """Mallory's node: stores anything, signs every record with her key, or injects raw bytes."""

    def __init__(self, identity: Identity, swarm: str):
        self.inner = SapoRecordValidator(identity, swarm, pow_difficulty=POW)
        self.identity = identity
        self.raw: dict[bytes, bytes] = {}  # key id -> exact value bytes to send

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key in self.raw:
            return self.raw[record.key]
        msg = record_message(record.key, record.subkey, record.value, record.expiration_time)
        return record.value + RECORD_SIG_MAGIC + self.identity.sign(msg)


async def test_owner_protection_against_a_malicious_peer(tmp_path):
    honest = await started(config(tmp_path, "h", record_ttl_s=20))
    witness = await started(config(tmp_path, "w", honest.visible_maddrs()))
    mallory_id = Identity.generate(POW)
    evil = EvilValidator(mallory_id, SWARM)
    mallory = hivemind.DHT(
        initial_peers=honest.visible_maddrs(), start=True, host_maddrs=LOOPBACK, record_validators=[evil]
    )
    try:
        hk = honest.identity.public_key_bytes
        h_subkey = owner_subkey(hk)
        original = batch(honest.identity, 1, "honest")
        assert await honest.publish(1, original)

        # 1. Mallory writes her own signed batch under the honest peer's subkey of round 1
        forged = batch(mallory_id, 1, "forged")
        mallory.store(batch_key(SWARM, hk, 1), forged, get_dht_time() + 60, subkey=h_subkey)

        # 2. she replays the honest, validly signed record under round 2 and with a later expiration
        exp = get_dht_time() + 30
        rec = DHTRecord(key_id_bytes(batch_key(SWARM, hk, 1)), MSGPackSerializer.dumps(h_subkey),
                        MSGPackSerializer.dumps(original), exp)  # fmt: skip
        honest_raw = SapoRecordValidator(honest.identity, SWARM, pow_difficulty=POW).sign_value(rec)
        evil.raw[key_id_bytes(batch_key(SWARM, hk, 2))] = honest_raw
        mallory.store(batch_key(SWARM, hk, 2), b"ignored", exp, subkey=h_subkey)
        evil.raw.clear()
        evil.raw[key_id_bytes(batch_key(SWARM, hk, 1))] = honest_raw
        mallory.store(batch_key(SWARM, hk, 1), b"ignored", exp + 300, subkey=h_subkey)

        # positive control: Mallory's own, validly signed record does reach the honest peers
        mk = owner_subkey(mallory_id.public_key_bytes)
        assert mallory.store(
            batch_key(SWARM, mallory_id.public_key_bytes, 5), batch(mallory_id, 5), get_dht_time() + 60, subkey=mk
        )

        # the honest peers' stored records are unchanged
        for peer in (honest, witness):
            keys = [batch_key(SWARM, hk, 1), batch_key(SWARM, hk, 2), batch_key(SWARM, mallory_id.public_key_bytes, 5)]
            local = await peer.dht.run_coroutine(partial(_local_entries, keys=keys), return_future=True)
            entries = local.get(batch_key(SWARM, hk, 1), {})
            assert entries.get(h_subkey) is not None
            value, expiration = entries[h_subkey]
            assert value == original
            assert expiration < get_dht_time() + 25  # not extended to exp + 300
            assert h_subkey not in local.get(batch_key(SWARM, hk, 2), {})
            assert mk in local.get(batch_key(SWARM, mallory_id.public_key_bytes, 5), {})
        got = await witness.fetch()
        assert seen(got) == {(hk, 1)} and got[0].data == original
    finally:
        mallory.shutdown()
        await asyncio.gather(honest.shutdown(), witness.shutdown())


async def _local_entries(_dht, node, keys: list[str]) -> dict:
    """Inside a DHT process: this node's own storage for `keys`, stripped values."""
    out: dict = {}
    for key in keys:
        found = node.protocol.storage.get(DHTID.generate(source=key))
        if found is None:
            continue
        entries = {}
        for subkey, (raw, exp) in found.value.items():
            rec = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey), raw, exp)
            entries[subkey] = (MSGPackSerializer.loads(node.protocol.record_validator.strip_value(rec)), exp)
        out[key] = entries
    return out


@pytest.mark.parametrize("shards", [1, 64, 1024])
def test_the_rotation_reads_every_tier_shard_within_its_rounds_and_a_bounded_slice_per_fetch(tmp_path, shards):
    """The newcomer bound's first half (PROTOCOL §7): every shard of tiers 1-3 is read at least once in
    TIER_SCAN_ROUNDS fetches, highest tier first, and one fetch reads only ceil(S_t / TIER_SCAN_ROUNDS) of
    each tier's S_t shards, whatever the number of keys there."""
    reader = SwarmTransport(config(tmp_path, "reader", presence_shards=shards, create_identity=True))
    every = {presence_key(SWARM, s, t) for t in range(1, MAX_TIER + 1) for s in range(tier_shards(shards, t))}
    per_fetch = sum(math.ceil(tier_shards(shards, t) / TIER_SCAN_ROUNDS) for t in range(1, MAX_TIER + 1))
    read: set[str] = set()
    for _ in range(TIER_SCAN_ROUNDS):
        keys = reader.sampler.tier_slice()
        assert len(keys) == per_fetch and keys[0].startswith(presence_key(SWARM, 0, MAX_TIER).rsplit("/", 1)[0])
        read.update(keys)
    assert read == every
    assert tier_shards(shards, 1) == shards  # tier 1 (the default) holds most keys: as many shards as tier 0


def test_presence_records_a_clock_far_off_would_drop_are_counted(tmp_path):
    """Records dated more than their lifetime away from this clock are dropped as before, and counted once per
    peer, so the node can say when most peers look that far off (node/swarm/clock.py: its own clock, most
    likely)."""
    cfg = config(tmp_path, "reader")
    sampler = PresenceSampler(cfg, own_key=b"\x00" * 32)
    peers = [Identity.generate(POW) for _ in range(3)]
    now = time.time()
    dated = [now, now - cfg.record_ttl_s - 60, now + cfg.record_ttl_s + 60]
    entries = {
        p.public_key_bytes: encode_presence(PresenceRecord(WIRE_VERSION, SWARM, p.public_key_bytes, 4, t), p)
        for p, t in zip(peers, dated)
    }
    candidates: dict[bytes, int] = {}
    stats = FetchStats()
    sampler._take(entries, UniformChooser(), candidates, stats)
    assert (len(stats.presence_keys), len(stats.off_clock_keys)) == (3, 2)
    sampler._take(entries, UniformChooser(), candidates, stats)  # a key above tier 0 is in two shards
    assert (len(stats.presence_keys), len(stats.off_clock_keys)) == (3, 2)  # counted once
    assert list(candidates) == [peers[0].public_key_bytes]  # the two far off are not fetched from
