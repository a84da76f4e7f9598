"""Record validator, unit level: only owner-signed SAPO records in the right place are accepted."""

import pickle
import time

from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p.identity import Identity
from p2p.validators import SapoRecordValidator, key_id_bytes, owner_subkey, presence_key, round_key
from p2p.wire import PresenceRecord, RolloutBatch, TaskSpecWire, WireGroup, encode_presence, encode_signed

SWARM = "vtest"
HONEST, MALLORY = Identity.generate(), Identity.generate()


def batch_bytes(ident: Identity, rnd: int = 3, swarm: str = SWARM) -> bytes:
    group = WireGroup(TaskSpecWire("bf", {}, 1, 0), ["a", "b"], [1.0, 0.0])
    return encode_signed(RolloutBatch(1, swarm, rnd, ident.public_key_bytes, time.time(), "m", [group]), ident)


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
    pres = encode_presence(PresenceRecord(1, SWARM, HONEST.public_key_bytes, 3, time.time()), HONEST)
    assert v.validate(signed(v, record(presence_key(SWARM), HONEST, pres)))


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
    rec = record(round_key(SWARM, 3), MALLORY, batch_bytes(MALLORY))
    honest_subkey = record(round_key(SWARM, 3), HONEST, b"").subkey
    forged = DHTRecord(rec.key, honest_subkey, mv.sign_value(rec), rec.expiration_time)
    assert not SapoRecordValidator(HONEST, SWARM).validate(forged)


def test_envelope_must_be_by_owner_and_well_placed():
    mv = SapoRecordValidator(MALLORY, SWARM)
    # Mallory re-publishes HONEST's batch under her own subkey
    assert mv.check(signed(mv, record(round_key(SWARM, 3), MALLORY, batch_bytes(HONEST)))) == (
        "envelope signer is not the subkey owner"
    )
    assert mv.check(signed(mv, record(round_key(SWARM, 4), MALLORY, batch_bytes(MALLORY, 3)))) == (
        "batch under a wrong key"
    )
    other = batch_bytes(MALLORY, 3, swarm="other")
    assert mv.check(signed(mv, record(round_key(SWARM, 3), MALLORY, other))) == "payload is for another swarm"
    pres = encode_presence(PresenceRecord(1, SWARM, MALLORY.public_key_bytes, 3, time.time()), MALLORY)
    assert mv.check(signed(mv, record(round_key(SWARM, 3), MALLORY, pres))) == "presence record under a wrong key"


def test_foreign_records_rejected():
    v = SapoRecordValidator(HONEST, SWARM)
    none_subkey, value = MSGPackSerializer.dumps(None), MSGPackSerializer.dumps(b"v")
    plain = DHTRecord(key_id_bytes("x"), none_subkey, value, get_dht_time() + 9)
    assert not v.validate(plain)
    odd_subkey = DHTRecord(plain.key, MSGPackSerializer.dumps(b"[owner:abc]"), plain.value, plain.expiration_time)
    assert not v.validate(odd_subkey)
    garbage = record(round_key(SWARM, 3), HONEST, b"garbage")
    assert not v.validate(signed(v, garbage))


def test_far_expiration_rejected():
    v = SapoRecordValidator(HONEST, SWARM, max_ttl_s=100)
    rec = signed(v, record(round_key(SWARM, 3), HONEST, batch_bytes(HONEST), exp=get_dht_time() + 1000))
    assert v.check(rec) == "expiration too far in the future"


def test_picklable():
    v = pickle.loads(pickle.dumps(SapoRecordValidator(HONEST, SWARM)))
    assert v.validate(signed(v, record(round_key(SWARM, 3), HONEST, batch_bytes(HONEST))))
