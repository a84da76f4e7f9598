"""Owner-protected DHT records for one swarm.

hivemind lets any peer write any (key, subkey). We only accept records whose subkey names an
Ed25519 key (b"[ed25519:<64 hex>]") and whose value carries that key's signature over
(DHT key id, subkey, value, expiration time): a third party can neither overwrite a peer's
entry, nor move it to another round key, nor extend its expiration. The value itself must be a
signed SAPO envelope by the same key, for this swarm, under the key it belongs to. Every other
record is rejected: a SAPO DHT stores nothing else.

hivemind only shows validators the DHTID (hash) of a key, so keys are compared by hash.
"""

from __future__ import annotations

import re
import struct
from collections import Counter
from typing import Any

import orjson
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time, get_logger
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p.identity import SIGNATURE_LEN, Identity
from p2p.wire import KIND_BATCH, KIND_PRESENCE, WireCaps, WireError, open_envelope

logger = get_logger(__name__)

SUBKEY_RE = re.compile(rb"^\[ed25519:([0-9a-f]{64})\]$")
RECORD_SIG_MAGIC = b"SAPOSIG1"
TRAILER_LEN = len(RECORD_SIG_MAGIC) + SIGNATURE_LEN
RECORD_SIG_DOMAIN = b"sapo-dht-record-v1\x00"
MAX_RECORD_TTL_S = 3600.0  # records expiring later than now + this are refused (bounds DHT garbage)


def owner_subkey(public_key: bytes) -> bytes:
    """The DHT subkey a peer owns under every SAPO key."""
    return b"[ed25519:" + public_key.hex().encode() + b"]"


def round_key(swarm: str, round_: int) -> str:
    return f"sapo/{swarm}/round/{round_}"


def presence_key(swarm: str) -> str:
    return f"sapo/{swarm}/peers"


def key_id_bytes(key: str) -> bytes:
    """What hivemind puts in DHTRecord.key for a string key."""
    return DHTID.generate(source=key).to_bytes()


def reason_code(reason: str) -> str:
    """A `check()` reason as a counter key: "envelope: bad_signature" -> "dht_envelope_bad_signature"."""
    return "dht_" + re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")


def record_message(key: bytes, subkey: bytes, value: bytes, expiration_time: float) -> bytes:
    """Bytes signed for a DHT record: domain tag, length-prefixed fields, expiration as f64 BE."""
    parts = [RECORD_SIG_DOMAIN]
    for field in (key, subkey, value):
        parts.append(struct.pack(">I", len(field)))
        parts.append(field)
    parts.append(struct.pack(">d", expiration_time))
    return b"".join(parts)


class SapoRecordValidator(RecordValidatorBase):
    """Signs this peer's records and rejects every record that is not a valid owned SAPO record."""

    def __init__(
        self, identity: Identity, swarm: str, caps: WireCaps = WireCaps(), max_ttl_s: float = MAX_RECORD_TTL_S
    ) -> None:
        self._identity = identity
        self._swarm = swarm
        self._caps = caps
        self._max_ttl_s = max_ttl_s
        self._own_subkey = MSGPackSerializer.dumps(owner_subkey(identity.public_key_bytes))
        self._presence_id = key_id_bytes(presence_key(swarm))
        self.rejections: Counter = Counter()  # reason_code -> records refused (stores and get answers)

    # DHT is a forked process today, but keep the validator picklable (run_coroutine pickles).
    def __getstate__(self) -> dict[str, Any]:
        seed = self._identity.private_bytes()
        return {"seed": seed, "swarm": self._swarm, "caps": self._caps, "ttl": self._max_ttl_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ident = Identity(Ed25519PrivateKey.from_private_bytes(state["seed"]))
        self.__init__(ident, state["swarm"], state["caps"], state["ttl"])  # type: ignore[misc]

    @property
    def priority(self) -> int:
        return 10  # validate before (and sign after) any deserializing validator

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.subkey != self._own_subkey:
            return record.value  # not ours to sign: validate() will reject it
        msg = record_message(record.key, record.subkey, record.value, record.expiration_time)
        return record.value + RECORD_SIG_MAGIC + self._identity.sign(msg)

    def strip_value(self, record: DHTRecord) -> bytes:
        if len(record.value) >= TRAILER_LEN and record.value[-TRAILER_LEN:-SIGNATURE_LEN] == RECORD_SIG_MAGIC:
            return record.value[:-TRAILER_LEN]
        return record.value

    def validate(self, record: DHTRecord) -> bool:
        reason = self.check(record)
        if reason is not None:
            logger.debug(f"rejected DHT record: {reason}")
            self.rejections[reason_code(reason)] += 1
        return reason is None

    def check(self, record: DHTRecord) -> str | None:
        """None if the record is valid, else a short reason (exposed for tests and diagnostics)."""
        owner = self._owner(record.subkey)
        if owner is None:
            return "subkey is not [ed25519:<hex>]"
        value = record.value
        if len(value) < TRAILER_LEN or value[-TRAILER_LEN:-SIGNATURE_LEN] != RECORD_SIG_MAGIC:
            return "no record signature"
        stripped, sig = value[:-TRAILER_LEN], value[-SIGNATURE_LEN:]
        if record.expiration_time > get_dht_time() + self._max_ttl_s:
            return "expiration too far in the future"
        if not Identity.verify(owner, record_message(record.key, record.subkey, stripped, record.expiration_time), sig):
            return "bad record signature"
        try:
            envelope = MSGPackSerializer.loads(stripped)
        except Exception:
            return "value is not msgpack"
        if not isinstance(envelope, bytes):
            return "value is not bytes"
        try:
            env = open_envelope(envelope, self._caps.max_batch_bytes)
        except WireError as e:
            return f"envelope: {e.reason}"
        if env.publisher != owner:
            return "envelope signer is not the subkey owner"
        return self._check_placement(record.key, env.payload)

    def _check_placement(self, key_id: bytes, payload: bytes) -> str | None:
        """The payload must belong to this swarm and sit under the key its contents name."""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return "payload is not JSON"
        if not isinstance(obj, dict) or obj.get("swarm") != self._swarm:
            return "payload is for another swarm"
        kind = obj.get("kind")
        if kind == KIND_PRESENCE:
            return None if key_id == self._presence_id else "presence record under a wrong key"
        if kind == KIND_BATCH:
            rnd = obj.get("round")
            if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
                return "batch without a valid round"
            return None if key_id == key_id_bytes(round_key(self._swarm, rnd)) else "batch under a wrong key"
        return "unknown payload kind"

    @staticmethod
    def _owner(subkey_bytes: bytes) -> bytes | None:
        try:
            subkey = MSGPackSerializer.loads(subkey_bytes)
        except Exception:
            return None
        if not isinstance(subkey, bytes):
            return None
        m = SUBKEY_RE.match(subkey)
        return bytes.fromhex(m.group(1).decode()) if m else None
