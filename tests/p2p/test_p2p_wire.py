"""Wire format: round trip, and every rejection reason in the documented check order."""

import json
import time

import orjson
import pytest

from p2p.identity import Identity
from p2p.wire import (
    HEADER_LEN,
    MAX_ROUND,
    REASONS,
    WIRE_VERSION,
    PresenceRecord,
    RolloutBatch,
    TaskSpecWire,
    WireCaps,
    WireError,
    WireGroup,
    canonical_json,
    decode_presence,
    decode_signed,
    encode_presence,
    encode_signed,
    seal,
)

ME = Identity.generate()


def make_batch(groups: int = 2, completions: int = 3, chars: int = 20, ident: Identity = ME) -> RolloutBatch:
    return RolloutBatch(
        version=WIRE_VERSION,
        swarm="test",
        round=7,
        publisher=ident.public_key_bytes,
        created_at=time.time(),
        model="Qwen2.5-0.5B",
        groups=[
            WireGroup(
                task=TaskSpecWire("basic_arithmetic", {"min_terms": 2, "max_terms": 4}, seed=11, index=i),
                completions=["é" * chars for _ in range(completions)],
                rewards=[0.0, 1.0, 0.5][:completions] + [0.0] * max(0, completions - 3),
            )
            for i in range(groups)
        ],
    )


def reason_of(data: bytes, caps: WireCaps = WireCaps(), pow_difficulty: int = 0) -> str:
    with pytest.raises(WireError) as err:
        decode_signed(data, caps, pow_difficulty)
    assert err.value.reason in REASONS
    return err.value.reason


def resign(payload_obj: dict, ident: Identity = ME) -> bytes:
    return seal(canonical_json(payload_obj), ident)


def payload_of(data: bytes) -> dict:
    return orjson.loads(data[HEADER_LEN:])


def test_round_trip():
    batch = make_batch()
    data = encode_signed(batch, ME)
    assert decode_signed(data) == batch


def test_encoding_is_canonical():
    batch = make_batch()
    a, b = encode_signed(batch, ME), encode_signed(batch, ME)
    assert a == b  # Ed25519 is deterministic and the payload has sorted keys
    payload = a[HEADER_LEN:]
    assert payload == canonical_json(orjson.loads(payload))


def test_presence_round_trip():
    rec = PresenceRecord(WIRE_VERSION, "test", ME.public_key_bytes, 12, time.time())
    assert decode_presence(encode_presence(rec, ME)) == rec


def test_cannot_encode_for_someone_else():
    with pytest.raises(ValueError):
        encode_signed(make_batch(ident=Identity.generate()), ME)


def test_bad_signature_and_tampering():
    data = bytearray(encode_signed(make_batch(), ME))
    data[HEADER_LEN - 1] ^= 1  # signature byte
    assert reason_of(bytes(data)) == "bad_signature"
    data = bytearray(encode_signed(make_batch(), ME))
    data[-5] ^= 1  # payload byte
    assert reason_of(bytes(data)) == "bad_signature"
    data = bytearray(encode_signed(make_batch(), ME))
    data[10] ^= 1  # public key byte
    assert reason_of(bytes(data)) == "bad_signature"


def test_other_key_claiming_my_batch_is_publisher_mismatch():
    mallory = Identity.generate()
    obj = payload_of(encode_signed(make_batch(), ME))  # publisher field = ME
    assert reason_of(resign(obj, mallory)) == "publisher_mismatch"


def test_oversize_checked_before_anything_else():
    # a huge blob of garbage is rejected by size alone (not 'malformed')
    assert reason_of(b"\xff" * (WireCaps().max_batch_bytes + 1)) == "oversize"
    data = encode_signed(make_batch(), ME)
    assert reason_of(data, WireCaps(max_batch_bytes=len(data) - 1)) == "oversize"


@pytest.mark.parametrize("garbage", [b"", b"SAPO", b"not a batch at all" * 20, b"\x00" * 200])
def test_garbage_is_malformed(garbage):
    assert reason_of(garbage) == "malformed"


def test_envelope_version():
    data = bytearray(encode_signed(make_batch(), ME))
    data[4] = 1  # a protocol v1 peer
    assert reason_of(bytes(data)) == "version"


def test_payload_version():
    obj = payload_of(encode_signed(make_batch(), ME))
    obj["version"] = WIRE_VERSION + 1
    assert reason_of(resign(obj)) == "version"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.pop("groups"),
        lambda o: o.update(round=-1),
        lambda o: o.update(round="7"),
        lambda o: o.update(kind="presence"),
        lambda o: o.update(swarm=""),
        lambda o: o["groups"][0].update(rewards=[1.0]),
        lambda o: o["groups"][0].update(completions=[1, 2, 3]),
        lambda o: o["groups"][0]["task"].update(seed=True),
        lambda o: o["groups"][0]["task"].update(config=[1]),
        lambda o: o.update(version="1"),
    ],
)
def test_schema(mutate):
    obj = payload_of(encode_signed(make_batch(), ME))
    mutate(obj)
    assert reason_of(resign(obj)) == "schema"


def test_signed_non_json_payload_is_schema():
    assert reason_of(seal(b"\x00not json", ME)) == "schema"


def test_caps():
    assert reason_of(encode_signed(make_batch(groups=65), ME)) == "too_many_groups"
    assert reason_of(encode_signed(make_batch(completions=33), ME)) == "too_many_completions"
    assert reason_of(encode_signed(make_batch(chars=8001), ME)) == "completion_too_long"
    decode_signed(encode_signed(make_batch(groups=64, completions=32, chars=10), ME))
    decode_signed(encode_signed(make_batch(completions=1, chars=8000), ME))  # 8000 code points, 16000 bytes
    big = make_batch()
    big.groups[0].task.config = {"k": "v" * 5000}
    assert reason_of(encode_signed(big, ME)) == "config_too_large"
    assert reason_of(encode_signed(make_batch(groups=3), ME), WireCaps(max_groups=2)) == "too_many_groups"


def test_presence_is_not_a_batch():
    rec = PresenceRecord(WIRE_VERSION, "test", ME.public_key_bytes, 1, time.time())
    assert reason_of(encode_presence(rec, ME)) == "schema"


# ---- hardening: every number from the wire finite and in range; strict JSON; proof of work


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(round=MAX_ROUND + 1),
        lambda o: o.update(round=2**70),
        lambda o: o.update(created_at=1e300),
        lambda o: o.update(created_at=-1.0),
        lambda o: o["groups"][0].update(rewards=[1e308, 0.0, 0.0]),
        lambda o: o["groups"][0]["task"].update(seed=2**64),
        lambda o: o["groups"][0]["task"].update(index=-1),
    ],
)
def test_numbers_out_of_range_are_schema(mutate):
    obj = payload_of(encode_signed(make_batch(), ME))
    mutate(obj)
    assert reason_of(seal(json.dumps(obj, sort_keys=True).encode(), ME)) == "schema"  # json writes any int


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_are_schema(literal):
    obj = payload_of(encode_signed(make_batch(), ME))
    field = b'"created_at":' + orjson.dumps(obj["created_at"])
    payload = canonical_json(obj)
    assert field in payload
    assert reason_of(seal(payload.replace(field, b'"created_at":' + literal), ME)) == "schema"


@pytest.mark.parametrize("where", ["top", "nested"])
def test_duplicate_member_names_are_refused(where):
    payload = canonical_json(payload_of(encode_signed(make_batch(), ME)))
    if where == "top":  # a second "round" after the first one: orjson alone would keep the last
        doubled = payload.replace(b'"round":7', b'"round":7,"round":8')
    else:
        doubled = payload.replace(b'"seed":', b'"seed":1,"seed":', 1)
    assert doubled != payload
    assert reason_of(seal(doubled, ME)) == "schema"
    rec = PresenceRecord(WIRE_VERSION, "test", ME.public_key_bytes, 3, time.time())
    pres = canonical_json(payload_of(encode_presence(rec, ME))).replace(b'"round":3', b'"round":3,"round":9')
    with pytest.raises(WireError, match="duplicate"):
        decode_presence(seal(pres, ME))


def test_json_nested_deeper_than_the_stdlib_parser_is_schema():
    """orjson reads 1000 levels, the duplicate-name check's stdlib parser does not: a WireError, not a crash."""
    assert reason_of(seal(b"[" * 1000 + b"]" * 1000, ME)) == "schema"


@pytest.mark.parametrize("depth", [300, 900])  # readable by both parsers, deeper than orjson writes (255)
def test_task_config_nested_deeper_than_the_encoder_writes_is_schema(depth):
    """The config is re-encoded (its size cap, content digests): a nesting that cannot be is a WireError."""
    payload = canonical_json(payload_of(encode_signed(make_batch(), ME)))
    config = b'"config":{"max_terms":4,"min_terms":2}'
    assert config in payload
    deep = payload.replace(config, b'"config":{"k":' + b"[" * depth + b"]" * depth + b"}", 1)
    assert reason_of(seal(deep, ME)) == "schema"


def test_presence_numbers_and_size_are_bounded():
    rec = PresenceRecord(WIRE_VERSION, "test", ME.public_key_bytes, 3, time.time())
    obj = payload_of(encode_presence(rec, ME))
    for bad in ({"round": MAX_ROUND + 1}, {"updated_at": 1e300}, {"round": -3}):
        with pytest.raises(WireError) as e:
            decode_presence(resign({**obj, **bad}))
        assert e.value.reason == "schema"
    with pytest.raises(WireError) as e:
        decode_presence(resign({**obj, "swarm": "s" * 600}))
    assert e.value.reason == "oversize"  # presence records are small by construction


def test_proof_of_work_is_checked_before_the_signature():
    weak = Identity.generate(0)
    strong = Identity.generate(10)
    for ident in (weak, strong):
        assert decode_signed(encode_signed(make_batch(ident=ident), ident), pow_difficulty=0).round == 7
    assert decode_signed(encode_signed(make_batch(ident=strong), strong), pow_difficulty=10).round == 7
    data = bytearray(encode_signed(make_batch(ident=weak), weak))
    assert reason_of(bytes(data), pow_difficulty=10) == "weak_identity"
    data[-5] ^= 1  # a forged payload by a key without work is refused for the work, before any signature check
    assert reason_of(bytes(data), pow_difficulty=10) == "weak_identity"


def test_a_swarm_name_is_refused_up_front_unless_its_presence_records_always_fit(tmp_path):
    """A presence record over the cap is refused by every peer, ours included: the node would publish
    batches nobody ever finds. So the longest name that fits must fit at the largest round and the longest
    time, and one byte more must be refused when the transport is configured."""
    import math

    from p2p.transport import TransportConfig
    from p2p.wire import MAX_ROUND, MAX_TIMESTAMP, PresenceRecord, decode_presence, encode_presence, presence_fits

    ident = Identity.generate()
    longest = max(n for n in range(1, 300) if presence_fits("s" * n))
    rec = PresenceRecord(
        WIRE_VERSION, "s" * longest, ident.public_key_bytes, MAX_ROUND, math.nextafter(MAX_TIMESTAMP, 0)
    )
    assert decode_presence(encode_presence(rec, ident)).swarm == "s" * longest
    TransportConfig(identity_dir=tmp_path, swarm="s" * longest)
    with pytest.raises(ValueError, match="swarm name too long"):
        TransportConfig(identity_dir=tmp_path, swarm="s" * (longest + 1))
