"""Record validator, unit level: only owner-signed SAPO records in the right place are accepted."""

import pickle
import time

from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p.identity import Identity
from p2p.pow import MAX_TIER, TIER_BITS, work_bits, work_tier
from p2p.validators import (
    SapoRecordValidator,
    batch_key,
    key_id_bytes,
    owner_of_subkey,
    owner_subkey,
    presence_key,
    presence_keys_for,
    presence_shard,
    tier_shards,
)
from p2p.wire import (
    HEADER_LEN,
    WIRE_VERSION,
    PresenceRecord,
    RolloutBatch,
    TaskSpecWire,
    WireGroup,
    encode_presence,
    encode_signed,
    seal,
)

SWARM = "vtest"
HONEST, MALLORY = Identity.generate(), Identity.generate()


def round_key(swarm: str, rnd: int, owner: Identity = HONEST) -> str:
    return batch_key(swarm, owner.public_key_bytes, rnd)


def presence_key_of(owner: Identity) -> str:
    return presence_key(SWARM, presence_shard(owner.public_key_bytes, 64))


def batch_bytes(ident: Identity, rnd: int = 3, swarm: str = SWARM) -> bytes:
    group = WireGroup(TaskSpecWire("bf", {}, 1, 0), ["a", "b"], [1.0, 0.0])
    return encode_signed(
        RolloutBatch(WIRE_VERSION, swarm, rnd, ident.public_key_bytes, time.time(), "m", [group]), ident
    )


def record(key: str, owner: Identity, envelope: bytes, exp: float | None = None) -> DHTRecord:
    return DHTRecord(
        key=key_id_bytes(key),
        subkey=MSGPackSerializer.dumps(owner_subkey(owner.public_key_bytes)),
        value=MSGPackSerializer.dumps(envelope),
        expiration_time=exp if exp is not None else get_dht_time() + 60,
    )


def signed(validator: SapoRecordValidator, rec: DHTRecord) -> DHTRecord:
    return DHTRecord(rec.key, rec.subkey, validator.sign_value(rec), rec.expiration_time)


def test_owner_record_accepted_and_stripped():
    v = SapoRecordValidator(HONEST, SWARM)
    env = batch_bytes(HONEST)
    rec = signed(v, record(round_key(SWARM, 3), HONEST, env))
    assert v.check(rec) is None
    assert MSGPackSerializer.loads(v.strip_value(rec)) == env
    pres = encode_presence(PresenceRecord(WIRE_VERSION, SWARM, HONEST.public_key_bytes, 3, time.time()), HONEST)
    assert v.validate(signed(v, record(presence_key_of(HONEST), HONEST, pres)))


def test_the_subkey_parser_reads_exactly_what_owner_subkey_writes():
    key = HONEST.public_key_bytes
    assert owner_of_subkey(owner_subkey(key)) == key
    for other in (
        owner_subkey(key) + b"\n",
        owner_subkey(key).upper(),
        owner_subkey(key[:31]),
        b"[owner:abc]",
        owner_subkey(key).decode(),
        None,
    ):
        assert owner_of_subkey(other) is None, other


def test_cannot_sign_for_another_owner():
    mv = SapoRecordValidator(MALLORY, SWARM)
    rec = record(round_key(SWARM, 3), HONEST, batch_bytes(HONEST))
    assert mv.sign_value(rec) == rec.value  # left unsigned
    assert not mv.validate(rec)


def test_moved_or_extended_record_rejected():
    v = SapoRecordValidator(HONEST, SWARM)
    rec = signed(v, record(round_key(SWARM, 3), HONEST, batch_bytes(HONEST)))
    assert v.validate(rec)
    moved = DHTRecord(key_id_bytes(round_key(SWARM, 4)), rec.subkey, rec.value, rec.expiration_time)
    assert v.check(moved) == "bad record signature"
    extended = DHTRecord(rec.key, rec.subkey, rec.value, rec.expiration_time + 100)
    assert v.check(extended) == "bad record signature"


def test_forged_signature_under_honest_subkey_rejected():
    # Mallory signs the record with her own key but puts it under HONEST's subkey
    mv = SapoRecordValidator(MALLORY, SWARM)
    rec = record(round_key(SWARM, 3, MALLORY), MALLORY, batch_bytes(MALLORY))
    honest_subkey = record(round_key(SWARM, 3), HONEST, b"").subkey
    forged = DHTRecord(rec.key, honest_subkey, mv.sign_value(rec), rec.expiration_time)
    assert not SapoRecordValidator(HONEST, SWARM).validate(forged)


def test_envelope_must_be_by_owner_and_well_placed():
    mv = SapoRecordValidator(MALLORY, SWARM)
    # Mallory re-publishes HONEST's batch under her own subkey
    assert mv.check(signed(mv, record(round_key(SWARM, 3, MALLORY), MALLORY, batch_bytes(HONEST)))) == (
        "envelope signer is not the subkey owner"
    )
    assert mv.check(signed(mv, record(round_key(SWARM, 4, MALLORY), MALLORY, batch_bytes(MALLORY, 3)))) == (
        "batch under a wrong key"
    )
    other = batch_bytes(MALLORY, 3, swarm="other")
    assert mv.check(signed(mv, record(round_key(SWARM, 3, MALLORY), MALLORY, other))) == "payload is for another swarm"
    pres = encode_presence(PresenceRecord(WIRE_VERSION, SWARM, MALLORY.public_key_bytes, 3, time.time()), MALLORY)
    assert (
        mv.check(signed(mv, record(round_key(SWARM, 3, MALLORY), MALLORY, pres))) == "presence record under a wrong key"
    )


def test_foreign_records_rejected():
    v = SapoRecordValidator(HONEST, SWARM)
    none_subkey, value = MSGPackSerializer.dumps(None), MSGPackSerializer.dumps(b"v")
    plain = DHTRecord(key_id_bytes("x"), none_subkey, value, get_dht_time() + 9)
    assert not v.validate(plain)
    odd_subkey = DHTRecord(plain.key, MSGPackSerializer.dumps(b"[owner:abc]"), plain.value, plain.expiration_time)
    assert not v.validate(odd_subkey)
    garbage = record(round_key(SWARM, 3), HONEST, b"garbage")
    assert not v.validate(signed(v, garbage))


def test_a_record_no_check_foresaw_is_refused_and_counted():
    """A record whose check raises (here JSON too deep for the stdlib parser, before the fix a RecursionError
    into hivemind, which dropped the whole answer of that peer) is one refused record."""
    v = SapoRecordValidator(HONEST, SWARM)
    deep = signed(v, record(round_key(SWARM, 3), HONEST, seal(b"[" * 1000 + b"]" * 1000, HONEST)))
    assert not v.validate(deep)
    v.check = lambda rec: 1 / 0  # whatever a future check gets wrong
    assert not v.validate(deep) and v.rejections["dht_unreadable_record"] == 1


def test_far_expiration_rejected():
    v = SapoRecordValidator(HONEST, SWARM, max_ttl_s=100)
    rec = signed(v, record(round_key(SWARM, 3), HONEST, batch_bytes(HONEST), exp=get_dht_time() + 1000))
    assert v.check(rec) == "expiration too far in the future"


def test_picklable():
    v = pickle.loads(pickle.dumps(SapoRecordValidator(HONEST, SWARM)))
    assert v.validate(signed(v, record(round_key(SWARM, 3), HONEST, batch_bytes(HONEST))))


# ---- hardening (protocol v2)


def test_expiration_must_be_a_finite_time():
    v = SapoRecordValidator(HONEST, SWARM)
    for exp in (float("nan"), float("inf"), float("-inf"), -5.0, 0.0):
        rec = signed(v, record(round_key(SWARM, 3), HONEST, batch_bytes(HONEST), exp=exp))
        assert v.check(rec) == "expiration is not a finite time", exp
        assert not v.validate(rec)
    assert v.rejections["dht_expiration_is_not_a_finite_time"] == 5


def test_key_without_proof_of_work_is_refused():
    strict = SapoRecordValidator(HONEST, SWARM, pow_difficulty=12)
    weak = Identity.generate(0)
    rec = signed(SapoRecordValidator(weak, SWARM), record(round_key(SWARM, 3, weak), weak, batch_bytes(weak)))
    assert SapoRecordValidator(HONEST, SWARM).check(rec) is None  # valid at difficulty 0...
    assert strict.check(rec) == "envelope: weak_identity"  # ...refused where the swarm asks for work
    strong = Identity.generate(12)
    own = SapoRecordValidator(strong, SWARM, pow_difficulty=12)
    assert strict.check(signed(own, record(round_key(SWARM, 3, strong), strong, batch_bytes(strong)))) is None


def test_presence_only_in_its_own_shard_and_small():
    v = SapoRecordValidator(HONEST, SWARM)
    pres = encode_presence(PresenceRecord(WIRE_VERSION, SWARM, HONEST.public_key_bytes, 3, time.time()), HONEST)
    own = presence_shard(HONEST.public_key_bytes, 64)
    other = presence_key(SWARM, (own + 1) % 64)
    assert v.check(signed(v, record(other, HONEST, pres))) == "presence record under a wrong key"
    huge = encode_presence(PresenceRecord(WIRE_VERSION, SWARM, HONEST.public_key_bytes, 3, time.time()), HONEST)
    huge = huge[:-1] + b',"pad":"' + b"x" * 600 + b'"}'
    huge = seal(huge[HEADER_LEN:], HONEST)  # re-signed: a valid signature on a too-large record
    assert v.check(signed(v, record(presence_key_of(HONEST), HONEST, huge))) == "presence record too large"


def test_old_protocol_is_refused_with_one_log_line(caplog):
    v = SapoRecordValidator(HONEST, SWARM)
    old = bytearray(batch_bytes(HONEST))
    old[4] = 1  # envelope version of protocol v1
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert v.check(signed(v, record(round_key(SWARM, 3), HONEST, bytes(old)))) == "older protocol version"
            assert not v.validate(signed(v, record(round_key(SWARM, 3), HONEST, bytes(old))))
    lines = [r for r in caplog.records if "older SAPO protocol" in r.getMessage()]
    assert len(lines) == 1


def test_signs_for_every_hosted_identity_only():
    extra = Identity.generate()
    v = SapoRecordValidator(HONEST, SWARM, also_sign_for=(extra,))
    assert v.check(signed(v, record(round_key(SWARM, 3, extra), extra, batch_bytes(extra)))) is None
    assert v.sign_value(record(round_key(SWARM, 3, MALLORY), MALLORY, b"x")) == MSGPackSerializer.dumps(b"x")
    back = pickle.loads(pickle.dumps(v))
    assert back.check(signed(back, record(round_key(SWARM, 4, extra), extra, batch_bytes(extra, 4)))) is None


def test_presence_sits_in_tier_0_and_in_its_keys_work_tier():
    """Every key's presence sits in its tier-0 shard (where any v2 reader looks); a key with work above the
    swarm minimum also in its work tier's (fewer) shards, and there only: it cannot claim a tier it has not
    paid for."""
    difficulty = 2
    rich = Identity.generate(difficulty + TIER_BITS)  # at least tier 1
    poor = next(
        i
        for i in iter(lambda: Identity.generate(difficulty), None)
        if work_bits(i.public_key_bytes, i.pow_nonce) < difficulty + TIER_BITS
    )  # tier 0
    assert work_tier(rich.public_key_bytes, rich.pow_nonce, difficulty) >= 1
    for owner in (rich, poor):
        v = SapoRecordValidator(owner, SWARM, pow_difficulty=difficulty)
        pres = encode_presence(PresenceRecord(WIRE_VERSION, SWARM, owner.public_key_bytes, 3, time.time()), owner)
        accepted = [
            (t, s)
            for t in range(MAX_TIER + 1)
            for s in range(tier_shards(64, t))
            if v.check(signed(v, record(presence_key(SWARM, s, t), owner, pres))) is None
        ]
        tier = work_tier(owner.public_key_bytes, owner.pow_nonce, difficulty)
        homes = presence_keys_for(SWARM, owner.public_key_bytes, owner.pow_nonce, difficulty, 64)
        assert [t for t, _ in accepted] == sorted({0, tier}) and len(homes) == len(accepted)
        assert [presence_key(SWARM, s, t) for t, s in accepted] == homes
        assert accepted[0] == (0, presence_shard(owner.public_key_bytes, 64))
