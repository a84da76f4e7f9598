"""Publish and fetch signed rollout batches over a hivemind DHT, without blocking the event loop.

Protocol v2 (docs/PROTOCOL.md): a batch lives alone under its (publisher, round) key, and a presence
record ("I am alive, my latest round is R") under its presence shards (`p2p.presence`). One fetch
samples presence for a bounded set of candidates, then fetches at most `fetch_max` batches chosen by the
caller's `PublisherChooser` (uniformly by default): its cost is bounded by constants, not by the swarm size.
An announced batch that is not there (a "ghost") is reported to the chooser. Network trouble never raises
out of publish/fetch: it returns what it has and logs. What runs inside hivemind's DHT process is in
`p2p.dht_process`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import hivemind
from hivemind.utils import get_dht_time

from p2p.config import TransportConfig
from p2p.dht_process import (
    ask,
    get_many_in_dht,
    live_peers_in_dht,
    settle,
    start_dht,
    stop_dht,
    store_from_file,
    takes_commands,
    unlink_quietly,
    validator_rejections_in_dht,
    wait_ready,
)
from p2p.identity import KEY_FILENAME, Identity, IdentityError
from p2p.pow import work_tier
from p2p.presence import FetchStats, PresenceSampler, PublisherChooser, UniformChooser
from p2p.validators import batch_key, owner_of_subkey, owner_subkey, presence_keys_for
from p2p.wire import WIRE_VERSION, PresenceRecord, encode_presence, open_envelope

logger = logging.getLogger(__name__)


# requests of one presence search in flight at once: over a long link a search that finds nothing (most shards
# of a small swarm) costs a round trip per request, and one worker sends them one after another;
# presence answers are small, so the extra replicas a few workers may hear from cost little
PRESENCE_WORKERS = 4


class TransportError(RuntimeError):
    """The transport could not start (no initial peer answered, p2pd failed, bad identity)."""


@dataclass(frozen=True)
class FetchedRecord:
    """A verified-envelope value as stored by `publisher` under its batch key (not yet schema-checked)."""

    publisher: bytes
    round: int
    data: bytes


class SwarmTransport:
    """One peer's view of the swarm: publish own batches, fetch a bounded sample of others' batches."""

    def __init__(self, config: TransportConfig, identity: Identity | None = None) -> None:
        self.config = config
        self.identity = identity or Identity.load_or_create(
            Path(config.identity_dir) / KEY_FILENAME,
            create=config.create_identity,
            pow_difficulty=config.pow_difficulty,
        )
        self._dht: hivemind.DHT | None = None
        self._maddrs: list[str] = []
        self.sampler = PresenceSampler(config, self.identity.public_key_bytes)
        self._subkey = owner_subkey(self.identity.public_key_bytes)
        self.last_fetch = FetchStats()

    @property
    def dht(self) -> hivemind.DHT:
        if self._dht is None:
            raise RuntimeError("transport not started")
        return self._dht

    async def start(self) -> None:
        """One attempt to start the DHT peer through the initial peers (TransportError when it fails).
        Interruptible: cancelled (a stop during start-up), it shuts the half-started peer down. Waits on the
        event loop, each bounded, never a thread left blocked: a stop must not wait for a start timeout."""
        cfg = self.config
        Path(cfg.identity_dir).mkdir(parents=True, exist_ok=True)
        assert cfg.p2p_identity_file is not None  # TransportConfig.__post_init__ fills it in
        try:  # forked here, on the event loop's thread: the DHT process's death signal follows this thread
            dht = start_dht(
                self.identity, Path(cfg.p2p_identity_file), cfg.swarm, cfg.initial_peers, cfg.host_maddrs,
                cfg.announce_maddrs, cfg.client_mode, cfg.caps, cfg.pow_difficulty, cfg.presence_shards,
            )  # fmt: skip
        except IdentityError as e:
            raise TransportError(str(e)) from e
        try:
            await wait_ready(dht, cfg.start_timeout_s)
            maddrs = await settle(dht)
        except BaseException as e:  # CancelledError included
            await stop_dht(dht)
            if not isinstance(e, Exception):
                raise
            hint = f" (initial peers: {cfg.initial_peers})" if cfg.initial_peers else ""
            raise TransportError(f"could not start the DHT peer{hint}: {type(e).__name__}: {e}") from e
        self._dht = dht
        self._maddrs = [str(m) for m in maddrs]
        logger.info("DHT peer %s up at %s", self.identity.peer_name, self._maddrs)

    @property
    def alive(self) -> bool:
        """The DHT peer is started, its process runs and it takes commands (`takes_commands`: one that stopped
        reading them would block the event loop once its pipe is full)."""
        return self._dht is not None and self._dht.is_alive() and takes_commands(self._dht)

    async def routing_peer_count(self, timeout: float) -> int | None:
        """Live peers in our routing table (a small table is pinged: `live_peers_in_dht`); None without a DHT
        or without an answer within `timeout`."""
        dht = self._dht
        if dht is None or not dht.is_alive():
            return None
        try:
            return await ask(dht, live_peers_in_dht, timeout)
        except Exception as e:  # asyncio.TimeoutError included
            logger.debug("routing table not read: %s: %s", type(e).__name__, e)
            return None

    @property
    def work_tier(self) -> int:
        """Our key's work tier in this swarm (readers explore never-tried keys of higher tiers first)."""
        return work_tier(self.identity.public_key_bytes, self.identity.pow_nonce, self.config.pow_difficulty)

    def visible_maddrs(self) -> list[str]:
        return list(self._maddrs)

    def known_peers(self) -> dict[str, int]:
        """pubkey hex -> latest round seen in that peer's presence record (other peers; a bounded memory)."""
        return dict(self.sampler.known)

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
        if not self.alive:  # solo (p2p.membership) or the DHT process died: the membership task restarts it
            logger.debug("publish of round %d skipped: no DHT peer", round)
            return False
        spill = self._spill(signed_batch)

        async def batch_then_presence() -> tuple[bool, bool]:
            # the batch first: a presence record must never announce a batch that is not stored, since readers
            # count an announced batch they cannot find as a ghost (evidence against its publisher).
            # `store_from_file` says whether any replica holds it, not only the last one to answer
            ok_batch = await self.dht.run_coroutine(
                partial(
                    store_from_file,
                    key=batch_key(cfg.swarm, me, round),
                    subkey=self._subkey,
                    path=spill,
                    expiration=expiration,
                ),  # fmt: skip
                return_future=True,
            )
            if not ok_batch:
                return False, False
            stored = await asyncio.gather(
                *(self.dht.store(home, presence, expiration, subkey=self._subkey, return_future=True) for home in homes)
            )
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
            unlink_quietly(spill)
        if not ok_batch:
            logger.warning("publish of round %d not stored: no DHT peer took the batch", round)
        elif not ok_presence:  # hivemind's answer is the last replica's: the others may hold it
            logger.debug("round %d: a DHT peer refused our presence record", round)
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

    async def fetch(self, max_bytes: int | None = None, chooser: PublisherChooser | None = None) -> list[FetchedRecord]:
        """At most `fetch_max` new batches among a bounded sample, chosen by `chooser` (uniform by default),
        which also decides whom to skip before any batch is fetched (`PublisherChooser.allowed`). Records beyond
        `max_bytes` in total are dropped. Partial results on timeout; never raises on network trouble.
        """
        chooser = chooser or UniformChooser()
        stats = self.last_fetch = FetchStats()
        if not self.alive:
            logger.debug("fetch skipped: no DHT peer")
            return []
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.config.fetch_timeout_s
        candidates = await self.sampler.sample(self._get_presence, deadline, stats, chooser)
        tiers = {pub: self.sampler.tiers.get(pub, 0) for pub in candidates}
        chosen = [
            (pub, candidates[pub])
            for pub in chooser.choose(candidates, self.config.fetch_max, tiers)
            if pub in candidates
        ][: self.config.fetch_max]
        stats.batches_requested = len(chosen)
        gets = [
            asyncio.ensure_future(self._get_many([batch_key(self.config.swarm, pub, r)], deadline, missing=True))
            for pub, r in chosen
        ]
        out: list[FetchedRecord] = []
        total = 0
        for (pub, r), fut in zip(chosen, gets):
            answer = await fut
            if answer is None:  # timed out or failed: no evidence either way
                continue
            value = next(iter(answer.values()), {}).get(pub)
            if value is None:
                stats.missing += 1
                self.sampler.mark_fetched(pub, r)  # a ghost is asked once
                chooser.missing(pub, r)
                continue
            stats.batches_received += 1
            stats.received(value)
            if max_bytes is not None and total + len(value) > max_bytes:
                stats.over_budget += 1
                continue
            total += len(value)
            self.sampler.mark_fetched(pub, r)
            out.append(FetchedRecord(publisher=pub, round=r, data=value))
        stats.seconds = loop.time() - started
        return out

    def fetch_again(self, records: list[FetchedRecord]) -> None:
        """Offer these batches again to later fetches (while they stay in the window): the reader could not
        judge them this round (its verification budget ran out), so they were not really received."""
        for rec in records:
            self.sampler.unmark_fetched(rec.publisher, rec.round)

    def forget_fetched(self) -> None:
        """Fetch already-fetched batches again (benchmarks measure every sample as a fresh round)."""
        self.sampler.fetched.clear()

    async def _get_presence(self, keys: list[str], deadline: float) -> dict[str, dict[bytes, bytes]] | None:
        """Presence shards (small values): PRESENCE_WORKERS requests of a search at once."""
        return await self._get_many(keys, deadline, workers=PRESENCE_WORKERS)

    async def _get_many(
        self, keys: list[str], deadline: float | None = None, missing: bool = False, workers: int = 1
    ) -> dict[str, dict[bytes, bytes]] | None:
        """key -> {publisher key -> envelope bytes} for the keys found, in one DHT search; None when the
        search timed out or failed (so a caller can tell "not there" from "no answer"). With `missing`,
        a key that was not found maps to {} (the search completed: evidence that nothing is stored).

        hivemind asks a peer for all the keys it may hold in one message, so this is used for small
        values only (presence shards); one batch per call.
        """
        loop = asyncio.get_running_loop()
        timeout = self.config.fetch_timeout_s if deadline is None else max(0.0, deadline - loop.time())
        dht = self._dht
        if dht is None:  # shut down meanwhile (p2p.membership restarts it): no answer
            return None
        if timeout <= 0:  # the caller's deadline has passed: asking now would only load the DHT process
            logger.debug("DHT get of %d key(s) not asked: no time left", len(keys))
            return None
        try:
            found = await ask(dht, partial(get_many_in_dht, keys=keys, workers=workers), timeout)
        except asyncio.TimeoutError:
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
        try:
            return dict(await ask(self._dht, validator_rejections_in_dht, timeout))
        except Exception as e:  # asyncio.TimeoutError included: diagnostics must never break a round
            logger.debug("could not read validator rejections: %s: %s", type(e).__name__, e)
            return {}

    async def shutdown(self) -> None:
        dht, self._dht = self._dht, None
        self._maddrs = []
        if dht is not None:
            await stop_dht(dht)
