"""Owner-protected DHT records for one swarm, and the key layout of protocol v2.

hivemind lets any peer write any (key, subkey). We only accept records whose subkey names an
Ed25519 key (b"[ed25519:<64 hex>]") with enough proof of work, whose expiration is a finite time
at most MAX_RECORD_TTL_S ahead, and whose value carries that key's signature over (DHT key id,
subkey, value, expiration time): a third party can neither overwrite a peer's entry, nor move it
to another key, nor extend its expiration. The value itself must be a signed SAPO envelope by the
same key, for this swarm, under the one key it belongs to. Every other record is rejected: a SAPO
DHT stores nothing else.

Keys (no key that every publisher writes): a batch lives alone under its (publisher, round) key;
a presence record lives under one of `shards` presence keys chosen by a hash of the publisher.

hivemind only shows validators the DHTID (hash) of a key, so keys are compared by hash.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections import Counter
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time, get_logger

from p2p.identity import SIGNATURE_LEN, Identity
from p2p.pow import TIER_BITS, work_tier
from p2p.wire import (
    ENVELOPE_VERSION,
    KIND_BATCH,
    KIND_PRESENCE,
    MAX_PRESENCE_BYTES,
    MAX_ROUND,
    WIRE_VERSION,
    WireCaps,
    WireError,
    envelope_version,
    open_envelope,
    parse_payload_json,
)

logger = get_logger(__name__)

SUBKEY_RE = re.compile(rb"\[ed25519:([0-9a-f]{64})\]")  # whole subkey (fullmatch): no trailing newline
RECORD_SIG_MAGIC = b"SAPOSIG1"
TRAILER_LEN = len(RECORD_SIG_MAGIC) + SIGNATURE_LEN
RECORD_SIG_DOMAIN = b"sapo-dht-record-v1\x00"
OLD_VERSION_REASON = "older protocol version"
MAX_RECORD_TTL_S = 3600.0  # records expiring later than now + this are refused (bounds DHT garbage)
DEFAULT_PRESENCE_SHARDS = 64
MAX_PRESENCE_SHARDS = 4096
KEY_PREFIX = f"sapo/v{WIRE_VERSION}"


def owner_subkey(public_key: bytes) -> bytes:
    """The DHT subkey a peer owns under every SAPO key."""
    return b"[ed25519:" + public_key.hex().encode() + b"]"


def owner_of_subkey(subkey: Any) -> bytes | None:
    """The public key an `owner_subkey` names; None for anything else (the one parser of the format)."""
    m = SUBKEY_RE.fullmatch(subkey) if isinstance(subkey, bytes) else None
    return bytes.fromhex(m.group(1).decode()) if m else None


def batch_key(swarm: str, publisher: bytes, round_: int) -> str:
    """The key of one publisher's batch for one round: nobody else writes there."""
    return f"{KEY_PREFIX}/{swarm}/batch/{publisher.hex()}/{round_}"


def presence_shard(publisher: bytes, shards: int) -> int:
    """The presence shard a publisher writes to: a hash of its key, so it cannot pick one for free."""
    return int.from_bytes(hashlib.sha256(b"sapo-presence-shard\x00" + publisher).digest()[:8], "big") % shards


def presence_key(swarm: str, shard: int, tier: int = 0) -> str:
    """Tier 0 holds every key (the swarm's minimum proof of work); tier t >= 1 again the keys with t tiers of
    extra work, on fewer shards (see pow.py), so that a reader can meet them first."""
    return f"{KEY_PREFIX}/{swarm}/presence/{shard}" if tier == 0 else f"{KEY_PREFIX}/{swarm}/presence/t{tier}/{shard}"


def tier_shards(shards: int, tier: int) -> int:
    """Shards of a work tier. Tier 1, where the reference node mints its key, has as many as tier 0 (it holds
    most honest peers, so its shards must stay as small); each tier above has 16x fewer (its keys cost 16x
    more, so expect 16x fewer of them)."""
    return shards if tier == 0 else max(1, shards >> (TIER_BITS * (tier - 1)))


def presence_home(swarm: str, publisher: bytes, tier: int, shards: int) -> str:
    """The key of a publisher's presence shard in `tier`."""
    return presence_key(swarm, presence_shard(publisher, tier_shards(shards, tier)), tier)


def presence_keys_for(swarm: str, publisher: bytes, nonce: bytes, pow_difficulty: int, shards: int) -> list[str]:
    """The keys this publisher (with this proof-of-work nonce) writes its presence record under: its tier-0
    shard, as every v2 peer reads it, and its work tier's shard when that tier is above 0."""
    tier = work_tier(publisher, nonce, pow_difficulty)
    return [presence_home(swarm, publisher, t, shards) for t in sorted({0, tier})]


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
        self,
        identity: Identity,
        swarm: str,
        caps: WireCaps = WireCaps(),
        max_ttl_s: float = MAX_RECORD_TTL_S,
        pow_difficulty: int = 0,
        presence_shards: int = DEFAULT_PRESENCE_SHARDS,
        also_sign_for: tuple[Identity, ...] = (),
    ) -> None:
        """`also_sign_for`: more identities hosted by this DHT process (benchmarks and Sybil tests only)."""
        self._identity = identity
        self._swarm = swarm
        self._caps = caps
        self._max_ttl_s = max_ttl_s
        self._pow_difficulty = pow_difficulty
        self._shards = presence_shards
        self._also = tuple(also_sign_for)
        self._signers = {MSGPackSerializer.dumps(owner_subkey(i.public_key_bytes)): i for i in (identity, *self._also)}
        self.rejections: Counter = Counter()  # reason_code -> records refused (stores and get answers)
        self.old_version_logged = False

    # DHT is a forked process today, but keep the validator picklable (run_coroutine pickles).
    def __getstate__(self) -> dict[str, Any]:
        seeds = [(i.private_bytes(), i.pow_nonce) for i in (self._identity, *self._also)]
        return {
            "seeds": seeds,
            "swarm": self._swarm,
            "caps": self._caps,
            "ttl": self._max_ttl_s,
            "pow": self._pow_difficulty,
            "shards": self._shards,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        ids = [Identity(Ed25519PrivateKey.from_private_bytes(seed), nonce) for seed, nonce in state["seeds"]]
        SapoRecordValidator.__init__(
            self, ids[0], state["swarm"], state["caps"], state["ttl"], state["pow"], state["shards"], tuple(ids[1:])
        )

    @property
    def priority(self) -> int:
        return 10  # validate before (and sign after) any deserializing validator

    def sign_value(self, record: DHTRecord) -> bytes:
        signer = self._signers.get(record.subkey)
        if signer is None:
            return record.value  # not ours to sign: validate() will reject it
        msg = record_message(record.key, record.subkey, record.value, record.expiration_time)
        return record.value + RECORD_SIG_MAGIC + signer.sign(msg)

    def strip_value(self, record: DHTRecord) -> bytes:
        if len(record.value) >= TRAILER_LEN and record.value[-TRAILER_LEN:-SIGNATURE_LEN] == RECORD_SIG_MAGIC:
            return record.value[:-TRAILER_LEN]
        return record.value

    def validate(self, record: DHTRecord) -> bool:
        try:
            reason = self.check(record)
        except Exception as exc:  # a check we did not foresee failing: one bad record must hide only itself
            logger.debug(f"DHT record check failed: {exc!r}")
            reason = "unreadable record"
        if reason is not None:
            logger.debug(f"rejected DHT record: {reason}")
            self.rejections[reason_code(reason)] += 1
            if reason == OLD_VERSION_REASON and not self.old_version_logged:
                self.old_version_logged = True  # one line per process, however many old records arrive
                logger.warning(
                    f"refusing DHT records of an older SAPO protocol (this peer speaks v{WIRE_VERSION}); "
                    "peers still on it must upgrade to exchange with this swarm"
                )
        return reason is None

    def check(self, record: DHTRecord) -> str | None:
        """None if the record is valid, else a short reason (exposed for tests and diagnostics)."""
        owner = self._owner(record.subkey)  # hivemind hands validators the subkey msgpack-serialized
        if owner is None:
            return "subkey is not [ed25519:<hex>]"
        value = record.value
        if len(value) < TRAILER_LEN or value[-TRAILER_LEN:-SIGNATURE_LEN] != RECORD_SIG_MAGIC:
            return "no record signature"
        stripped, sig = value[:-TRAILER_LEN], value[-SIGNATURE_LEN:]
        expiration = record.expiration_time
        if not isinstance(expiration, (int, float)) or not math.isfinite(expiration) or expiration <= 0:
            return "expiration is not a finite time"
        if expiration > get_dht_time() + self._max_ttl_s:
            return "expiration too far in the future"
        if not Identity.verify(owner, record_message(record.key, record.subkey, stripped, record.expiration_time), sig):
            return "bad record signature"
        try:
            envelope = MSGPackSerializer.loads(stripped)
        except Exception:
            return "value is not msgpack"
        if not isinstance(envelope, bytes):
            return "value is not bytes"
        if envelope_version(envelope) not in (None, ENVELOPE_VERSION):
            return OLD_VERSION_REASON
        try:
            env = open_envelope(envelope, self._caps.max_batch_bytes, self._pow_difficulty)
        except WireError as e:
            return f"envelope: {e.reason}"
        if env.publisher != owner:
            return "envelope signer is not the subkey owner"
        return self._check_placement(record.key, owner, env.nonce, env.payload, len(envelope))

    def _check_placement(self, key_id: bytes, owner: bytes, nonce: bytes, payload: bytes, size: int) -> str | None:
        """The payload must belong to this swarm and sit under the one key its contents name."""
        try:
            obj = parse_payload_json(payload)
        except WireError:
            return "payload is not strict JSON"
        if not isinstance(obj, dict) or obj.get("swarm") != self._swarm:
            return "payload is for another swarm"
        if obj.get("version") != WIRE_VERSION:
            return OLD_VERSION_REASON
        kind = obj.get("kind")
        if kind == KIND_PRESENCE:
            if size > MAX_PRESENCE_BYTES:
                return "presence record too large"
            homes = presence_keys_for(self._swarm, owner, nonce, self._pow_difficulty, self._shards)
            return None if key_id in map(key_id_bytes, homes) else "presence record under a wrong key"
        if kind == KIND_BATCH:
            rnd = obj.get("round")
            if not isinstance(rnd, int) or isinstance(rnd, bool) or not 0 <= rnd <= MAX_ROUND:
                return "batch without a valid round"
            return None if key_id == key_id_bytes(batch_key(self._swarm, owner, rnd)) else "batch under a wrong key"
        return "unknown payload kind"

    @staticmethod
    def _owner(subkey_bytes: bytes) -> bytes | None:
        try:
            subkey = MSGPackSerializer.loads(subkey_bytes)
        except Exception:
            return None
        return owner_of_subkey(subkey)


def keep_valid_subkeys(protocol: Any) -> None:
    """Make `protocol` (a hivemind DHTProtocol, inside the DHT process) drop only the invalid subkeys of a
    dictionary value instead of the whole dictionary.

    hivemind refuses a whole dictionary answer when one of its subkeys fails validation, so one bad
    record from a replica would hide every honest record beside it (presence shards hold many).
    """
    validator = protocol.record_validator
    serializer = protocol.serializer

    def validate_dictionary(key_bytes: bytes, dictionary: Any) -> bool:
        if validator is None:
            return True
        with dictionary.freeze():
            bad = [
                subkey
                for subkey, (value, expiration) in dictionary.items()
                if not validator.validate(DHTRecord(key_bytes, serializer.dumps(subkey), value, expiration))
            ]
        for subkey in bad:
            del dictionary[subkey]
        return len(dictionary) > 0 or not bad

    protocol._validate_dictionary = validate_dictionary
