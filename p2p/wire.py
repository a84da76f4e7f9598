"""Wire format of what peers publish: signed rollout batches and signed presence records.

Envelope (binary, see docs/PROTOCOL.md):  b"SAPO" | envelope version (1 byte) | publisher
Ed25519 public key (32) | proof-of-work nonce (8) | signature (64) | payload (UTF-8 JSON).  The
signature covers the exact payload bytes, so receivers never re-serialize before verifying, and the
key and its proof of work sit in the header so both are checked before any JSON from an
unauthenticated sender is parsed. A payload whose JSON repeats a member name is refused: two
implementations could read it differently.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from p2p.identity import PUBLIC_KEY_LEN, SIGNATURE_LEN, Identity
from p2p.pow import NONCE_LEN, check_pow

MAGIC = b"SAPO"
ENVELOPE_VERSION = 2  # 1: protocol v1 (no proof of work in the header)
WIRE_VERSION = 2  # payload "version"; bumped together with the envelope and the DHT key layout
# payload "minor" (absent: 0): optional members an older peer ignores. 1: a group's "logp_mean"
WIRE_MINOR = 1
MIN_LOGP_MEAN = -1000.0  # a mean token log-prob is <= 0 and, for any sampled text, far above this
LOGP_DECIMALS = 4  # "logp_mean" is rounded to this many decimals: 7-8 bytes a completion
HEADER_LEN = len(MAGIC) + 1 + PUBLIC_KEY_LEN + NONCE_LEN + SIGNATURE_LEN
MAX_ROUND = 2**31 - 1
MAX_TIMESTAMP = 2.0**40  # seconds since the epoch; anything later is not a clock reading
MAX_ABS_REWARD = 1e6
MAX_INT = 2**63 - 1  # seeds and task indices: signed 64-bit, as every JSON library can hold them
MAX_PRESENCE_BYTES = 512
KIND_BATCH = "rollout_batch"
KIND_PRESENCE = "presence"

REASONS = frozenset(
    {
        "oversize",
        "malformed",
        "bad_signature",
        "publisher_mismatch",
        "schema",
        "version",
        "too_many_groups",
        "too_many_completions",
        "completion_too_long",
        "config_too_large",
        "weak_identity",
    }
)


class WireError(ValueError):
    """A received value was rejected; `reason` is one of REASONS (for counters and logs)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class WireCaps:
    """Receiver-side limits; everything above is rejected before it can cost memory or time."""

    max_batch_bytes: int = 768 * 1024  # one DHT message carries one batch: stays under 1 MiB
    max_groups: int = 64
    max_completions: int = 32
    max_completion_chars: int = 8000
    max_config_bytes: int = 4096
    max_name_chars: int = 256  # swarm, model and dataset names


@dataclass
class TaskSpecWire:
    """Enough to regenerate the task (and its ground truth) locally with reasoning-gym."""

    dataset: str
    config: dict[str, Any]
    seed: int
    index: int


@dataclass
class WireGroup:
    task: TaskSpecWire
    completions: list[str]
    rewards: list[float]  # the sender's own scores: informational only, receivers re-score
    # minor 1: per completion, the mean log-prob of its tokens under the publisher's sampling policy (mu), for
    # receivers that weigh another policy's samples (--external-loss is/ftis); a weight never exceeds 1
    logp_mean: list[float] | None = None


@dataclass
class RolloutBatch:
    version: int
    swarm: str
    round: int
    publisher: bytes  # 32-byte Ed25519 public key
    created_at: float  # sender's wall clock (time.time())
    model: str
    groups: list[WireGroup] = field(default_factory=list)


@dataclass
class PresenceRecord:
    """A peer's "I am alive and my latest round is R": rounds are not synchronized across peers."""

    version: int
    swarm: str
    publisher: bytes
    round: int
    updated_at: float


# ---------------------------------------------------------------- encoding


def canonical_json(obj: Any) -> bytes:
    """orjson with sorted keys (recursively); floats as orjson prints them (shortest round-trip)."""
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def batch_to_dict(batch: RolloutBatch) -> dict[str, Any]:
    return {
        "kind": KIND_BATCH,
        "version": batch.version,
        "minor": WIRE_MINOR,
        "swarm": batch.swarm,
        "round": batch.round,
        "publisher": batch.publisher.hex(),
        "created_at": batch.created_at,
        "model": batch.model,
        "groups": [_group_to_dict(g) for g in batch.groups],
    }


def _group_to_dict(g: WireGroup) -> dict[str, Any]:
    out: dict[str, Any] = {
        "task": {"dataset": g.task.dataset, "config": g.task.config, "seed": g.task.seed, "index": g.task.index},
        "completions": list(g.completions),
        "rewards": list(g.rewards),
    }
    if g.logp_mean is not None:
        out["logp_mean"] = [round(x, LOGP_DECIMALS) for x in g.logp_mean]
    return out


def presence_to_dict(rec: PresenceRecord) -> dict[str, Any]:
    return {
        "kind": KIND_PRESENCE,
        "version": rec.version,
        "swarm": rec.swarm,
        "publisher": rec.publisher.hex(),
        "round": rec.round,
        "updated_at": rec.updated_at,
    }


def seal(payload: bytes, identity: Identity) -> bytes:
    """Wrap payload bytes in a signed envelope."""
    return (
        MAGIC
        + bytes([ENVELOPE_VERSION])
        + identity.public_key_bytes
        + identity.pow_nonce
        + identity.sign(payload)
        + payload
    )


def encode_signed(batch: RolloutBatch, identity: Identity) -> bytes:
    """Canonical payload + signature by `identity`, which must be the batch's publisher."""
    if batch.publisher != identity.public_key_bytes:
        raise ValueError("batch.publisher must be the signing identity's public key")
    for g in batch.groups:
        if not all(math.isfinite(r) and abs(r) <= MAX_ABS_REWARD for r in g.rewards):
            raise ValueError("rewards must be finite and within +-MAX_ABS_REWARD")
        if g.logp_mean is not None and not _valid_logp_mean(g.logp_mean, len(g.completions)):
            raise ValueError(f"logp_mean must hold one number in [{MIN_LOGP_MEAN}, 0] per completion")
    if not 0 <= batch.created_at <= MAX_TIMESTAMP or not 0 <= batch.round <= MAX_ROUND:
        raise ValueError("created_at and round must be in range")
    return seal(canonical_json(batch_to_dict(batch)), identity)


def encode_presence(rec: PresenceRecord, identity: Identity) -> bytes:
    if rec.publisher != identity.public_key_bytes:
        raise ValueError("presence.publisher must be the signing identity's public key")
    return seal(canonical_json(presence_to_dict(rec)), identity)


def presence_fits(swarm: str) -> bool:
    """Whether this swarm's presence records stay under MAX_PRESENCE_BYTES at every round and time: the
    name is the only free-length field, and a record over the cap is refused by every peer, ours included."""
    longest_time = math.nextafter(MAX_TIMESTAMP, 0)  # 17 significant digits: the longest a time can print
    worst = PresenceRecord(WIRE_VERSION, swarm, bytes(PUBLIC_KEY_LEN), MAX_ROUND, longest_time)
    return HEADER_LEN + len(canonical_json(presence_to_dict(worst))) <= MAX_PRESENCE_BYTES


# ---------------------------------------------------------------- decoding


@dataclass(frozen=True)
class Envelope:
    publisher: bytes
    nonce: bytes  # the publisher key's proof of work (its work tier counts in presence placement)
    signature: bytes
    payload: bytes


def open_envelope(data: bytes, max_bytes: int, pow_difficulty: int = 0) -> Envelope:
    """Size cap, then shape, then proof of work, then signature. Parses no JSON."""
    if not isinstance(data, (bytes, bytearray)):
        raise WireError("malformed", "not bytes")
    if len(data) > max_bytes:
        raise WireError("oversize", f"{len(data)} > {max_bytes} bytes")
    if len(data) < HEADER_LEN + 2 or data[: len(MAGIC)] != MAGIC:
        raise WireError("malformed", "bad envelope header")
    if data[len(MAGIC)] != ENVELOPE_VERSION:
        raise WireError("version", f"envelope version {data[len(MAGIC)]}")
    start = len(MAGIC) + 1
    publisher = bytes(data[start : start + PUBLIC_KEY_LEN])
    nonce = envelope_nonce(data)
    signature = bytes(data[start + PUBLIC_KEY_LEN + NONCE_LEN : HEADER_LEN])
    payload = bytes(data[HEADER_LEN:])
    if not check_pow(publisher, nonce, pow_difficulty):
        raise WireError("weak_identity", f"public key without {pow_difficulty} bits of proof of work")
    if not Identity.verify(publisher, payload, signature):
        raise WireError("bad_signature")
    return Envelope(publisher, nonce, signature, payload)


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise WireError("schema", "duplicate member name in a JSON object")
    return obj


def parse_payload_json(payload: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate member names at any depth (else WireError)."""
    try:
        obj = orjson.loads(payload)  # refuses NaN, Infinity and invalid UTF-8
    except orjson.JSONDecodeError as e:
        raise WireError("schema", f"payload is not JSON: {e}") from None
    if isinstance(obj, (dict, list)):
        try:
            json.loads(payload, object_pairs_hook=_refuse_duplicates)  # orjson silently keeps the last duplicate
        except RecursionError:  # orjson nests up to 1024 levels, the stdlib parser fewer
            raise WireError("schema", "JSON nested too deeply") from None
    return obj


def _parse_payload(env: Envelope, kind: str) -> dict[str, Any]:
    obj = parse_payload_json(env.payload)
    if not isinstance(obj, dict):
        raise WireError("schema", "payload is not an object")
    if obj.get("kind") != kind:
        raise WireError("schema", f"kind {obj.get('kind')!r} != {kind!r}")
    version = obj.get("version")
    if not _is_int(version):
        raise WireError("schema", "version is not an int")
    if version != WIRE_VERSION:
        raise WireError("version", f"payload version {version}")
    if obj.get("publisher") != env.publisher.hex():
        raise WireError("publisher_mismatch", "payload publisher is not the signing key")
    return obj


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (isinstance(x, float) and math.isfinite(x)) or _is_int(x)


def _in_range(x: Any, low: float, high: float) -> bool:
    """A finite number (int or float) within [low, high]."""
    return _is_num(x) and low <= x <= high


def _is_round(x: Any) -> bool:
    return _is_int(x) and 0 <= x <= MAX_ROUND


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise WireError("schema", what)


def _name(obj: dict[str, Any], key: str, caps: WireCaps) -> str:
    v = obj.get(key)
    if not (isinstance(v, str) and 0 < len(v) <= caps.max_name_chars):
        raise WireError("schema", f"{key} must be a non-empty short string")
    return v


def decode_signed(data: bytes, caps: WireCaps = WireCaps(), pow_difficulty: int = 0) -> RolloutBatch:
    """Verify and parse a signed rollout batch: size, envelope, proof of work, signature, schema, caps."""
    env = open_envelope(data, caps.max_batch_bytes, pow_difficulty)
    obj = _parse_payload(env, KIND_BATCH)
    swarm, model = _name(obj, "swarm", caps), _name(obj, "model", caps)
    _require(_is_round(obj.get("round")), f"round must be an int in [0, {MAX_ROUND}]")
    _require(_in_range(obj.get("created_at"), 0, MAX_TIMESTAMP), "created_at must be a finite time in range")
    raw_groups = obj.get("groups")
    if not isinstance(raw_groups, list):
        raise WireError("schema", "groups must be a list")
    for g in raw_groups:
        _check_group_schema(g, caps)
    # caps (schema is known to hold from here on)
    if len(raw_groups) > caps.max_groups:
        raise WireError("too_many_groups", f"{len(raw_groups)} > {caps.max_groups}")
    groups = [_group_with_caps(g, caps) for g in raw_groups]
    return RolloutBatch(
        version=obj["version"],
        swarm=swarm,
        round=obj["round"],
        publisher=env.publisher,
        created_at=float(obj["created_at"]),
        model=model,
        groups=groups,
    )


def _check_group_schema(g: Any, caps: WireCaps) -> None:
    _require(isinstance(g, dict), "group must be an object")
    task = g.get("task")
    _require(isinstance(task, dict), "task must be an object")
    _name(task, "dataset", caps)
    _require(isinstance(task.get("config"), dict), "task.config must be an object")
    _require(_is_int(task.get("seed")) and -MAX_INT - 1 <= task["seed"] <= MAX_INT, "task.seed must be an int64")
    _require(_is_int(task.get("index")) and 0 <= task["index"] <= MAX_INT, "task.index must be an int in [0, 2^63)")
    comps, rewards = g.get("completions"), g.get("rewards")
    _require(isinstance(comps, list) and all(isinstance(c, str) for c in comps), "completions must be strings")
    _require(
        isinstance(rewards, list) and all(_in_range(r, -MAX_ABS_REWARD, MAX_ABS_REWARD) for r in rewards),
        "rewards must be finite numbers in range",
    )
    _require(len(rewards) == len(comps), "one reward per completion")
    if "logp_mean" in g:  # minor 1; a malformed one is the publisher's fault like any other schema error
        _require(
            _valid_logp_mean(g["logp_mean"], len(comps)),
            f"logp_mean must hold one number in [{MIN_LOGP_MEAN}, 0] per completion",
        )


def _valid_logp_mean(values: Any, n: int) -> bool:
    return isinstance(values, list) and len(values) == n and all(_in_range(x, MIN_LOGP_MEAN, 0.0) for x in values)


def _group_with_caps(g: dict[str, Any], caps: WireCaps) -> WireGroup:
    task = g["task"]
    group = WireGroup(
        task=TaskSpecWire(task["dataset"], task["config"], task["seed"], task["index"]),
        completions=g["completions"],
        rewards=[float(r) for r in g["rewards"]],
        logp_mean=[float(x) for x in g["logp_mean"]] if "logp_mean" in g else None,
    )
    check_group_caps(group, caps)
    return group


def check_group_caps(group: WireGroup, caps: WireCaps) -> None:
    """WireError when a group is over a receiver's caps: the decoder refuses it, the publisher leaves it out
    (a batch over the caps is an offence to every receiver, so an honest node must never sign one)."""
    comps = group.completions
    if len(comps) > caps.max_completions:
        raise WireError("too_many_completions", f"{len(comps)} > {caps.max_completions}")
    longest = max((len(c) for c in comps), default=0)
    if longest > caps.max_completion_chars:
        raise WireError("completion_too_long", f"{longest} > {caps.max_completion_chars} chars")
    try:
        config_size = len(canonical_json(group.task.config))
    except orjson.JSONEncodeError:  # nested deeper than orjson writes (255 levels; it reads 1024)
        raise WireError("schema", "task.config nested too deeply") from None
    if config_size > caps.max_config_bytes:
        raise WireError("config_too_large", f"{config_size} > {caps.max_config_bytes} bytes")


def decode_presence(data: bytes, max_bytes: int = MAX_PRESENCE_BYTES, pow_difficulty: int = 0) -> PresenceRecord:
    """Verify and parse a signed presence record (small by construction: MAX_PRESENCE_BYTES)."""
    env = open_envelope(data, max_bytes, pow_difficulty)
    obj = _parse_payload(env, KIND_PRESENCE)
    swarm = _name(obj, "swarm", WireCaps())
    _require(_is_round(obj.get("round")), f"round must be an int in [0, {MAX_ROUND}]")
    _require(_in_range(obj.get("updated_at"), 0, MAX_TIMESTAMP), "updated_at must be a finite time in range")
    return PresenceRecord(obj["version"], swarm, env.publisher, obj["round"], float(obj["updated_at"]))


def envelope_nonce(data: bytes) -> bytes:
    """The proof-of-work nonce in an envelope's header (checked by open_envelope; its work tier places
    presence records)."""
    start = len(MAGIC) + 1 + PUBLIC_KEY_LEN
    return bytes(data[start : start + NONCE_LEN])


def envelope_version(data: bytes) -> int | None:
    """The envelope version byte of something that starts like a SAPO envelope (for version diagnostics)."""
    if isinstance(data, (bytes, bytearray)) and len(data) > len(MAGIC) and data[: len(MAGIC)] == MAGIC:
        return data[len(MAGIC)]
    return None
