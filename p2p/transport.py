"""Publish and fetch signed rollout batches over a hivemind DHT, without blocking the event loop.

Protocol v2 (docs/PROTOCOL.md): a batch lives alone under its (publisher, round) key, and a presence
record ("I am alive, my latest round is R") under one of `presence_shards` keys chosen by a hash of the
publisher, and again among the shards of its work tier when its key carries proof of work above the
swarm's minimum (`p2p.pow`). Rounds are not synchronized across peers, so a reader learns rounds from
presence. One fetch reads presence shards (first those of the publishers the caller's `FetchPolicy`
prefers, then the next slice of every tier >= 1 in a rotation that covers each tier every
TIER_SCAN_ROUNDS rounds, then tier-0 shards in random order) until it holds a bounded sample of
candidates, then fetches at most
`fetch_max` batches chosen by the policy (uniformly by default) among the candidates it trusts: its
cost is bounded by constants, not by the swarm size. An announced batch that is not there (a "ghost")
is reported to the policy. Network trouble never raises out of publish/fetch:
it returns what it has and logs.

Why this module is long: it is the one place that knows the DHT layout (start, publish, sampled
fetch) plus the small coroutines that must run inside hivemind's DHT process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p.identity import KEY_FILENAME, Identity, IdentityError, libp2p_identity_path
from p2p.pow import DEFAULT_POW_DIFFICULTY, MAX_POW_DIFFICULTY, MAX_TIER, work_tier
from p2p.validators import DEFAULT_PRESENCE_SHARDS, MAX_PRESENCE_SHARDS, MAX_RECORD_TTL_S, SapoRecordValidator, \
    batch_key, keep_valid_subkeys, owner_subkey, presence_home, presence_key, presence_keys_for, \
    tier_shards
from p2p.wire import MAX_PRESENCE_BYTES, WIRE_VERSION, PresenceRecord, WireCaps, WireError, decode_presence, \
    encode_presence, envelope_nonce, open_envelope, presence_fits

logger = logging.getLogger(__name__)

MAX_KNOWN = 10_000  # publishers remembered for known_peers() and the fetched-round memory
FIRST_WAVE_SHARDS = 1  # then as many as the density seen says are needed: each answer stays small
MAX_WAVE_SHARDS = 8  # shards asked in one search at most (a replica answers all the keys it holds at once)
TIER_SCAN_ROUNDS = 8  # every shard of a tier >= 1 is read at least once in this many fetches (PROTOCOL §7)


class TransportError(RuntimeError):
    """The transport could not start (no initial peer answered, p2pd failed, bad identity)."""


@dataclass(kw_only=True)
class TransportConfig:
    identity_dir: Path
    swarm: str = "sapo-default"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    client_mode: bool = False
    fetch_timeout_s: float = 5.0
    publish_timeout_s: float = 5.0
    record_ttl_s: float = 600.0
    start_timeout_s: float = 60.0
    create_identity: bool = True  # False: a missing key is an error (a run dir that already has state)
    caps: WireCaps = field(default_factory=WireCaps)
    pow_difficulty: int = DEFAULT_POW_DIFFICULTY  # swarm-wide: keys with less work are refused
    presence_shards: int = DEFAULT_PRESENCE_SHARDS  # swarm-wide: part of the key layout
    fetch_max: int = 16  # K: batches fetched per round at most
    presence_sample: int = 0  # candidates to gather before choosing K (0 = 2 * fetch_max)

    def __post_init__(self) -> None:
        if not 0 < self.record_ttl_s <= MAX_RECORD_TTL_S:
            raise ValueError(f"record_ttl_s must be in (0, {MAX_RECORD_TTL_S}]: peers reject longer-lived records")
        if not 0 <= self.pow_difficulty <= MAX_POW_DIFFICULTY:
            raise ValueError(f"pow_difficulty must be in [0, {MAX_POW_DIFFICULTY}]")
        if not 1 <= self.presence_shards <= MAX_PRESENCE_SHARDS:
            raise ValueError(f"presence_shards must be in [1, {MAX_PRESENCE_SHARDS}]")
        if self.fetch_max < 1:
            raise ValueError("fetch_max must be >= 1")
        if not presence_fits(self.swarm):
            raise ValueError(f"swarm name too long ({len(self.swarm.encode())} bytes): its presence records would "
                             f"exceed {MAX_PRESENCE_BYTES} bytes and no peer would ever find this node")
        if self.presence_sample <= 0:
            self.presence_sample = 2 * self.fetch_max


@dataclass(frozen=True)
class FetchedRecord:
    """A verified-envelope value as stored by `publisher` under its batch key (not yet schema-checked)."""

    publisher: bytes
    round: int
    data: bytes


@dataclass
class FetchStats:
    """What the last fetch cost (for benchmarks and logs)."""

    shards_read: int = 0
    candidates: int = 0
    batches_requested: int = 0
    batches_received: int = 0
    bytes_received: int = 0  # values received (presence + batches), before any budget is applied
    largest_answer_bytes: int = 0
    over_budget: int = 0  # batches received but dropped by max_bytes
    missing: int = 0  # announced batches that a completed search did not find (ghosts)
    seconds: float = 0.0


def always_trusted(_publisher: bytes) -> bool:
    return True


class FetchPolicy(Protocol):
    """Whose batches a fetch reads (the node's bandit, `node.swarm.bandit`; `UniformPolicy` by default)."""

    def preferred(self, limit: int) -> list[bytes]:
        """Publishers whose presence shards are read first (at most `limit`)."""
        ...

    def fresh(self, publisher: bytes) -> bool:
        """Does this candidate count toward the presence sample?"""
        ...

    def choose(self, candidates: dict[bytes, int], k: int, tiers: Optional[dict[bytes, int]] = None) -> list[bytes]:
        """At most k of the candidates (publisher -> announced round) to fetch; `tiers`: their work tiers."""
        ...

    def missing(self, publisher: bytes, round: int) -> None:
        """A search for this announced batch completed and found nothing."""
        ...


class UniformPolicy:
    """Protocol §7's default: no preference, K chosen uniformly at random."""

    def preferred(self, limit: int) -> list[bytes]:
        return []

    def fresh(self, publisher: bytes) -> bool:
        return True

    def choose(self, candidates: dict[bytes, int], k: int, tiers: Optional[dict[bytes, int]] = None) -> list[bytes]:
        return random.sample(list(candidates), min(k, len(candidates)))

    def missing(self, publisher: bytes, round: int) -> None:
        return None


def start_dht(
    identity: Identity,
    identity_dir: Path,
    swarm: str,
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str],
    client_mode: bool = False,
    caps: WireCaps = WireCaps(),
    pow_difficulty: int = DEFAULT_POW_DIFFICULTY,
    presence_shards: int = DEFAULT_PRESENCE_SHARDS,
) -> hivemind.DHT:
    """Fork a DHT process with our validator and persistent libp2p identity (not yet awaited)."""
    p2p_path = libp2p_identity_path(identity_dir)
    if p2p_path.exists():
        try:
            PeerID.from_identity(p2p_path.read_bytes())
        except Exception as e:
            raise IdentityError(f"libp2p identity file {p2p_path} is unreadable or corrupt: {e}") from e
    kwargs: dict[str, Any] = dict(
        host_maddrs=host_maddrs,
        identity_path=str(p2p_path),
        client_mode=client_mode,
        ensure_bootstrap_success=bool(initial_peers),
    )
    if announce_maddrs:
        kwargs["announce_maddrs"] = announce_maddrs
    return hivemind.DHT(
        initial_peers=initial_peers or None,
        start=True,
        await_ready=False,
        record_validators=[SapoRecordValidator(identity, swarm, caps, pow_difficulty=pow_difficulty,
                                               presence_shards=presence_shards)],
        **kwargs,
    )


class SwarmTransport:
    """One peer's view of the swarm: publish own batches, fetch a bounded sample of others' batches."""

    def __init__(self, config: TransportConfig, identity: Optional[Identity] = None) -> None:
        self.config = config
        self.identity = identity or Identity.load_or_create(
            Path(config.identity_dir) / KEY_FILENAME, create=config.create_identity,
            pow_difficulty=config.pow_difficulty,
        )
        self._dht: Optional[hivemind.DHT] = None
        self._maddrs: list[str] = []
        self._known: dict[str, int] = {}
        self._tiers: dict[bytes, int] = {}  # publisher -> work tier seen in its presence (where to read it)
        self._fetched: dict[tuple[bytes, int], None] = {}  # (publisher, round) already fetched: never twice
        # where the rotation over each tier >= 1 goes on next fetch; a random start spreads readers' load
        self._scan_at = {t: random.randrange(tier_shards(config.presence_shards, t)) for t in range(1, MAX_TIER + 1)}
        self._subkey = owner_subkey(self.identity.public_key_bytes)
        self.last_fetch = FetchStats()

    @property
    def dht(self) -> hivemind.DHT:
        if self._dht is None:
            raise RuntimeError("transport not started")
        return self._dht

    async def start(self) -> None:
        cfg = self.config
        Path(cfg.identity_dir).mkdir(parents=True, exist_ok=True)
        dht = start_dht(
            self.identity, Path(cfg.identity_dir), cfg.swarm, cfg.initial_peers, cfg.host_maddrs,
            cfg.announce_maddrs, cfg.client_mode, cfg.caps, cfg.pow_difficulty, cfg.presence_shards,
        )  # fmt: skip
        self._dht = dht
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, dht.wait_until_ready, cfg.start_timeout_s)
            await loop.run_in_executor(None, die_with_parent, dht)
            await loop.run_in_executor(None, keep_valid_subkeys_in, dht)
            maddrs = await loop.run_in_executor(None, visible_maddrs, dht)
        except Exception as e:
            await self.shutdown()
            hint = f" (initial peers: {cfg.initial_peers})" if cfg.initial_peers else ""
            raise TransportError(f"could not start the DHT peer{hint}: {type(e).__name__}: {e}") from e
        self._maddrs = [str(m) for m in maddrs]
        logger.info("DHT peer %s up at %s", self.identity.peer_name, self._maddrs)

    @property
    def work_tier(self) -> int:
        """Our key's work tier in this swarm (readers explore never-tried keys of higher tiers first)."""
        return work_tier(self.identity.public_key_bytes, self.identity.pow_nonce, self.config.pow_difficulty)

    def visible_maddrs(self) -> list[str]:
        return list(self._maddrs)

    def known_peers(self) -> dict[str, int]:
        """pubkey hex -> latest round seen in that peer's presence record (other peers; a bounded memory)."""
        return dict(self._known)

    async def publish(self, round: int, signed_batch: bytes) -> bool:
        """Store our batch for `round` and refresh our presence record; False on failure or timeout."""
        env = open_envelope(signed_batch, self.config.caps.max_batch_bytes)  # our own bug if this raises
        if env.publisher != self.identity.public_key_bytes:
            raise ValueError("signed_batch was not signed by this transport's identity")
        cfg = self.config
        expiration = get_dht_time() + cfg.record_ttl_s
        me = self.identity.public_key_bytes
        presence = encode_presence(PresenceRecord(WIRE_VERSION, cfg.swarm, me, round, time.time()), self.identity)
        homes = presence_keys_for(cfg.swarm, me, self.identity.pow_nonce, cfg.pow_difficulty, cfg.presence_shards)
        if not self.dht.is_alive():
            logger.error("publish of round %d skipped: the DHT process is dead", round)
            return False
        spill = self._spill(signed_batch)

        async def batch_then_presence() -> tuple[bool, bool]:
            # the batch first: a presence record must never announce a batch that is not stored yet, since
            # readers count an announced batch they cannot find as a ghost (evidence against its publisher)
            ok_batch = await self.dht.run_coroutine(
                partial(_store_from_file, key=batch_key(cfg.swarm, me, round), subkey=self._subkey, path=spill,
                        expiration=expiration),  # fmt: skip
                return_future=True,
            )
            if not ok_batch:
                return False, False
            stored = await asyncio.gather(*(self.dht.store(home, presence, expiration, subkey=self._subkey,
                                                           return_future=True) for home in homes))
            if not all(stored[1:]):  # peers that do not know work tiers refuse the tier key: readers still
                logger.debug("round %d: presence not stored under our work tier's key", round)  # find tier 0
            return bool(ok_batch), bool(stored[0])  # homes[0] is the tier-0 key, where every reader looks

        try:
            ok_batch, ok_presence = await asyncio.wait_for(batch_then_presence(), cfg.publish_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("publish of round %d timed out after %.1fs", round, cfg.publish_timeout_s)
            return False
        except Exception as e:  # p2pd hiccups must not kill a training round
            logger.warning("publish of round %d failed: %s: %s", round, type(e).__name__, e)
            return False
        finally:
            _unlink_quietly(spill)
        if not (ok_batch and ok_presence):
            logger.warning("publish of round %d not stored (batch=%s presence=%s)", round, ok_batch, ok_presence)
        return bool(ok_batch)

    def _spill(self, value: bytes) -> str:
        """Write a value to a private temp file (tmpfs when available) for the DHT process to read.

        hivemind sends store() arguments over an mp.Pipe whose read end the DHT process has made
        non-blocking; a message over 16 KiB arrives in two writes and the reader dies with EAGAIN
        (DHT process gone, every later call hangs). So values travel by file, commands by pipe.
        """
        spill_dir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="sapo-store-", dir=spill_dir)
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        return path

    async def fetch(
        self, trusted: Callable[[bytes], bool] = always_trusted, max_bytes: Optional[int] = None,
        policy: Optional[FetchPolicy] = None,
    ) -> list[FetchedRecord]:
        """At most `fetch_max` new batches, chosen by `policy` (uniform by default) among a bounded sample.

        `trusted(publisher key)` filters candidates before any batch is fetched (reputation); records
        beyond `max_bytes` in total are dropped. Partial results on timeout; never raises on network trouble.
        """
        policy = policy or UniformPolicy()
        stats = self.last_fetch = FetchStats()
        if not self.dht.is_alive():
            logger.error("fetch skipped: the DHT process is dead")
            return []
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.config.fetch_timeout_s
        candidates = await self._sample_candidates(deadline, trusted, stats, policy)
        tiers = {pub: self._tiers.get(pub, 0) for pub in candidates}
        chosen = [(pub, candidates[pub]) for pub in policy.choose(candidates, self.config.fetch_max, tiers)
                  if pub in candidates][:self.config.fetch_max]
        stats.batches_requested = len(chosen)
        gets = [asyncio.ensure_future(self._get_many([batch_key(self.config.swarm, pub, r)], deadline, missing=True))
                for pub, r in chosen]
        out: list[FetchedRecord] = []
        total = 0
        for (pub, r), fut in zip(chosen, gets):
            answer = await fut
            if answer is None:  # timed out or failed: no evidence either way
                continue
            value = next(iter(answer.values()), {}).get(pub)
            if value is None:
                stats.missing += 1
                self._mark_fetched(pub, r)  # a ghost is asked once
                policy.missing(pub, r)
                continue
            stats.batches_received += 1
            stats.bytes_received += len(value)
            stats.largest_answer_bytes = max(stats.largest_answer_bytes, len(value))
            if max_bytes is not None and total + len(value) > max_bytes:
                stats.over_budget += 1
                continue
            total += len(value)
            self._mark_fetched(pub, r)
            out.append(FetchedRecord(publisher=pub, round=r, data=value))
        stats.seconds = loop.time() - started
        return out

    def _mark_fetched(self, pub: bytes, round_: int) -> None:
        self._fetched[(pub, round_)] = None
        while len(self._fetched) > MAX_KNOWN:
            del self._fetched[next(iter(self._fetched))]

    async def _sample_candidates(
        self, deadline: float, trusted: Callable[[bytes], bool], stats: FetchStats, policy: FetchPolicy,
    ) -> dict[bytes, int]:
        """Read presence shards until `presence_sample` fresh trusted candidates are known.

        Must-read, in the first searches: the shards of the policy's preferred publishers, then this
        fetch's slice of every tier >= 1 (highest first; the rotation reads each tier-t shard at least once
        in TIER_SCAN_ROUNDS fetches, so a key that paid for a tier is met within that many rounds however
        many cheaper keys there are). Then tier-0 shards (every key is there) in random order, as many as
        the density of fresh candidates seen so far says are still needed, at most MAX_WAVE_SHARDS per
        search. Bounded by the shards named here and the deadline, not by the swarm size.
        """
        cfg = self.config
        preferred = list(dict.fromkeys(self._home(p) for p in policy.preferred(cfg.fetch_max)))
        must = list(dict.fromkeys(preferred + self._tier_slice()))
        tier0 = [presence_key(cfg.swarm, s) for s in random.sample(range(cfg.presence_shards), cfg.presence_shards)]
        order = must + [key for key in tier0 if key not in must]
        candidates: dict[bytes, int] = {}
        loop = asyncio.get_running_loop()
        wave = min(len(order), max(FIRST_WAVE_SHARDS, min(len(must), MAX_WAVE_SHARDS)))
        n_must = len(must)
        while order and loop.time() < deadline:
            shards, order = order[:wave], order[wave:]
            answers = await self._get_many(shards, deadline) or {}
            stats.shards_read += len(shards)
            for entries in answers.values():
                self._take_presence(entries, trusted, candidates, stats)
            n_must = max(0, n_must - len(shards))
            fresh = sum(1 for p in candidates if policy.fresh(p))
            missing = cfg.presence_sample - fresh
            if missing <= 0 and n_must == 0:
                break
            density = fresh / stats.shards_read  # fresh candidates per shard so far
            wave = len(order) if density == 0 else max(1, math.ceil(missing / density))
            wave = min(len(order), MAX_WAVE_SHARDS, max(wave, min(n_must, MAX_WAVE_SHARDS)))
        stats.candidates = len(candidates)
        return candidates

    def _tier_slice(self) -> list[str]:
        """This fetch's shards of the tiers >= 1, highest tier first: the next ceil(S_t / TIER_SCAN_ROUNDS)
        of each tier's S_t shards in rotation (1, 1 and 8 at S = 64)."""
        keys = []
        for tier in range(MAX_TIER, 0, -1):
            n = tier_shards(self.config.presence_shards, tier)
            step, start = math.ceil(n / TIER_SCAN_ROUNDS), self._scan_at[tier]
            keys += [presence_key(self.config.swarm, (start + i) % n, tier) for i in range(step)]
            self._scan_at[tier] = (start + step) % n
        return keys

    def _take_presence(
        self, entries: dict[bytes, bytes], trusted: Callable[[bytes], bool], candidates: dict[bytes, int],
        stats: FetchStats,
    ) -> None:
        now = time.time()
        for pub, data in entries.items():
            stats.bytes_received += len(data)
            stats.largest_answer_bytes = max(stats.largest_answer_bytes, len(data))
            if pub == self.identity.public_key_bytes:
                continue
            try:
                rec = decode_presence(data, MAX_PRESENCE_BYTES, self.config.pow_difficulty)
            except WireError as e:
                logger.debug("bad presence record from %s: %s", pub.hex()[:16], e)
                continue
            if rec.swarm != self.config.swarm or rec.publisher != pub:
                continue
            if abs(now - rec.updated_at) > self.config.record_ttl_s:
                continue  # a stale record (or a clock far off): its batches are gone or not yet valid
            self._remember(self._known, pub.hex(), rec.round)
            self._remember(self._tiers, pub, work_tier(pub, envelope_nonce(data), self.config.pow_difficulty))
            if (pub, rec.round) in self._fetched or not trusted(pub):
                continue
            candidates[pub] = rec.round

    def _home(self, publisher: bytes) -> str:
        """The presence shard key of a publisher (at the tier its last presence record showed; 0 if unseen)."""
        return presence_home(self.config.swarm, publisher, self._tiers.get(publisher, 0), self.config.presence_shards)

    @staticmethod
    def _remember(memory: dict, key: Any, value: int) -> None:
        """Keep the largest value (newest round, highest tier) per key, forgetting the oldest-inserted keys
        beyond MAX_KNOWN."""
        memory[key] = max(value, memory.pop(key, -1))
        while len(memory) > MAX_KNOWN:
            del memory[next(iter(memory))]

    def forget_fetched(self) -> None:
        """Fetch already-fetched batches again (benchmarks measure every sample as a fresh round)."""
        self._fetched.clear()

    async def _get(self, key: str, deadline: Optional[float] = None) -> dict[bytes, bytes]:
        """publisher key -> stored envelope bytes; {} when missing, malformed, failed or timed out."""
        return ((await self._get_many([key], deadline)) or {}).get(key, {})

    async def _get_many(self, keys: list[str], deadline: Optional[float] = None,
                        missing: bool = False) -> Optional[dict[str, dict[bytes, bytes]]]:
        """key -> {publisher key -> envelope bytes} for the keys found, in one DHT search; None when the
        search timed out or failed (so a caller can tell "not there" from "no answer"). With `missing`,
        a key that was not found maps to {} (the search completed: evidence that nothing is stored).

        hivemind asks a peer for all the keys it may hold in one message, so this is used for small
        values only (presence shards); one batch per call. The first replica that answers is enough
        (one worker, latest=False): a batch key is written once, and a presence shard is re-read next
        round anyway, while asking every replica multiplies the bytes received.
        """
        loop = asyncio.get_running_loop()
        timeout = self.config.fetch_timeout_s if deadline is None else max(0.0, deadline - loop.time())
        future = self.dht.run_coroutine(partial(_get_many_in_dht, keys=keys), return_future=True)
        try:
            found = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            future.cancel()
            logger.warning("DHT get of %d key(s) (%s...) timed out after %.1fs", len(keys), keys[0], timeout)
            return None
        except Exception as e:
            logger.warning("DHT get %s... failed: %s: %s", keys[0], type(e).__name__, e)
            return None
        out: dict[str, dict[bytes, bytes]] = {key: {} for key in keys} if missing else {}
        for key, entries in found.items():
            for subkey, value in entries.items():
                pub = owner_of_subkey(subkey)
                if pub is not None and isinstance(value, bytes):
                    out.setdefault(key, {})[pub] = value
        return out

    async def validator_rejections(self, timeout: float = 5.0) -> dict[str, int]:
        """Records our DHT validator refused since start, by reason code (cumulative; {} if unavailable)."""
        if self._dht is None or not self._dht.is_alive():
            return {}
        future = self._dht.run_coroutine(_validator_rejections, return_future=True)
        try:
            return dict(await asyncio.wait_for(future, timeout))
        except Exception as e:  # asyncio.TimeoutError included: diagnostics must never break a round
            future.cancel()
            logger.debug("could not read validator rejections: %s: %s", type(e).__name__, e)
            return {}

    async def shutdown(self) -> None:
        dht, self._dht = self._dht, None
        if dht is not None:
            await asyncio.get_running_loop().run_in_executor(None, dht.shutdown)


def owner_of_subkey(subkey: Any) -> Optional[bytes]:
    if not isinstance(subkey, bytes) or not (subkey.startswith(b"[ed25519:") and subkey.endswith(b"]")):
        return None
    try:
        pub = bytes.fromhex(subkey[len(b"[ed25519:") : -1].decode())
    except ValueError:
        return None
    return pub if len(pub) == 32 else None


async def _get_many_in_dht(_dht: hivemind.DHT, node: Any, keys: list[str]) -> dict[str, dict[Any, Any]]:
    """Runs inside the DHT process: {key: {subkey: value}} of the dictionary values found (validated)."""
    found = await node.get_many(keys, sufficient_expiration_time=get_dht_time(), num_workers=1)
    out: dict[str, dict[Any, Any]] = {}
    for key, result in found.items():
        if result is not None and isinstance(result.value, dict):  # hivemind unpacks a dictionary value to a dict
            out[key] = {subkey: item.value for subkey, item in result.value.items()}
    return out


async def _store_from_file(
    _dht: hivemind.DHT, node: Any, key: str, subkey: bytes, path: str, expiration: float
) -> bool:
    """Runs inside the DHT process: store the value spilled to `path` (see SwarmTransport._spill)."""
    try:
        with open(path, "rb") as f:
            value = f.read()
    finally:
        _unlink_quietly(path)
    return bool(await node.store(key, value, expiration, subkey=subkey))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def _validator_rejections(_dht: hivemind.DHT, node: Any) -> dict[str, int]:
    """Runs inside the DHT process: the SAPO validator's rejection counters."""
    validator = node.protocol.record_validator
    out: dict[str, int] = {}
    for v in getattr(validator, "_validators", [validator]):
        if isinstance(v, SapoRecordValidator):
            for reason, n in v.rejections.items():
                out[reason] = out.get(reason, 0) + n
    return out


async def _die_with_parent(_dht: hivemind.DHT, node: Any, parent_pid: int) -> bool:
    """Runs inside the DHT process: be SIGKILLed (with p2pd, which follows it) when our parent dies (Linux).

    hivemind's DHT process never notices its parent's death (it holds both ends of its command pipe),
    so a node killed with SIGKILL (or by the OOM killer) left it running: it kept serving the dead
    peer's records and kept the listen port, so a restart on the same port could not bind.
    """
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def die_with_parent(dht: hivemind.DHT, timeout: float = 10.0) -> bool:
    """Blocking: tie `dht`'s process to this one (call from the thread that started it: the death signal
    follows the forking thread). False where unsupported or on failure; never raises."""
    try:
        return bool(dht.run_coroutine(partial(_die_with_parent, parent_pid=os.getpid()),
                                      return_future=True).result(timeout))
    except Exception as e:
        logger.warning("could not tie the DHT process to this one: %s: %s", type(e).__name__, e)
        return False


async def _keep_valid_subkeys(_dht: hivemind.DHT, node: Any) -> bool:
    keep_valid_subkeys(node.protocol)
    return True


def keep_valid_subkeys_in(dht: hivemind.DHT, timeout: float = 10.0) -> bool:
    """Blocking: make `dht` drop only the invalid subkeys of a dictionary answer (see validators.keep_valid_subkeys)."""
    return bool(dht.run_coroutine(_keep_valid_subkeys, return_future=True).result(timeout))


async def _routing_peers(_dht: hivemind.DHT, node: Any) -> list[str]:
    """Runs inside the DHT process: peer ids currently in the routing table (not replacements)."""
    return [str(pid) for bucket in node.protocol.routing_table.buckets for pid in bucket.nodes_to_peer_id.values()]


async def _visible_maddrs(_dht: hivemind.DHT, node: Any) -> list[Any]:
    return await node.get_visible_maddrs()


def visible_maddrs(dht: hivemind.DHT, timeout: float = 10.0) -> list[Any]:
    """Blocking: our multiaddrs as p2pd reports them; unlike hivemind's get_visible_maddrs it cannot wait forever
    on a stalled daemon (a restart on a loaded host once hung there with no message)."""
    return dht.run_coroutine(_visible_maddrs, return_future=True).result(timeout)


def routing_peers(dht: hivemind.DHT, timeout: float = 10.0) -> list[str]:
    """Blocking: peer ids in `dht`'s routing table (for status counters)."""
    return dht.run_coroutine(_routing_peers, return_future=True).result(timeout)
