"""Proof-of-work identities: a swarm identity costs CPU time to mint (S/Kademlia-style crypto puzzle).

An Ed25519 key is free, so without a cost one process can speak as hundreds of peers. A key is only
accepted together with an 8-byte nonce such that sha256(POW_DOMAIN | public key | nonce) starts with
`difficulty` zero bits. Minting takes 2**difficulty hashes on average; checking takes one. The nonce
never changes for a key, so it is minted once and stored beside the key (`identity.pow`).

Work beyond the swarm's minimum buys priority, not trust: every TIER_BITS extra bits (16x the mint) raise
a key's *work tier* by one (at most MAX_TIER). A key's presence record is also kept among the keys of its
tier, and readers meet never-tried keys of higher tiers first (docs/PROTOCOL.md, node policy): a Sybil swarm
that wants to crowd out a newcomer must mint its keys at the newcomer's tier, paying 16x per tier.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from p2p.files import write_atomically

logger = logging.getLogger(__name__)

POW_DOMAIN = b"sapo-pow-v1\x00"
NONCE_LEN = 8
DEFAULT_POW_DIFFICULTY = 20  # ~1 s to mint on one core of the development machine (docs/benchmarks/scale.md)
MAX_POW_DIFFICULTY = 40
POW_FILENAME = "identity.pow"
TIER_BITS = 4  # extra bits per work tier: each tier costs 16x the swarm's mint
MAX_TIER = 3
CHUNK = 1 << 14  # hashes between two looks at the clock and the stop flag (about 15 ms on one core)
LOG_FROM_BITS = 16  # below, a mint takes well under a second: it is not reported
RATE_PROBE_S = 0.5  # hashing this long measures the machine's rate before the estimate is given
PROGRESS_EVERY_S = 10.0


class PowError(Exception):
    """The nonce file is unreadable or corrupt."""


def leading_zero_bits(digest: bytes) -> int:
    n = 0
    for byte in digest:
        if byte == 0:
            n += 8
            continue
        return n + 8 - byte.bit_length()
    return n


def pow_digest(public_key: bytes, nonce: bytes) -> bytes:
    return hashlib.sha256(POW_DOMAIN + public_key + nonce).digest()


def check_pow(public_key: bytes, nonce: bytes, difficulty: int) -> bool:
    """True iff `nonce` proves `difficulty` bits of work on `public_key` (one hash)."""
    return difficulty <= 0 or work_bits(public_key, nonce) >= difficulty


def work_bits(public_key: bytes, nonce: bytes) -> int:
    """How many leading zero bits the key's proof of work has (one hash; 0 for a malformed nonce)."""
    if len(nonce) != NONCE_LEN:
        return 0
    return leading_zero_bits(pow_digest(public_key, nonce))


def work_tier(public_key: bytes, nonce: bytes, difficulty: int) -> int:
    """The key's work tier in a swarm of this difficulty: whole TIER_BITS above it, capped at MAX_TIER."""
    return max(0, min(MAX_TIER, (work_bits(public_key, nonce) - difficulty) // TIER_BITS))


def tier_difficulty(difficulty: int, tier: int) -> int:
    """Bits a key must carry to sit in `tier` (capped at MAX_POW_DIFFICULTY)."""
    return min(MAX_POW_DIFFICULTY, difficulty + TIER_BITS * max(0, min(MAX_TIER, tier)))


class MintStopped(Exception):
    """A stop was requested while minting. `next_counter` is where the search stood: nonces below it were
    tried (the search is deterministic, so a later mint of the same key goes on from there)."""

    def __init__(self, next_counter: int):
        super().__init__(f"proof of work stopped at {next_counter} hashes")
        self.next_counter = next_counter


class MintMeter:
    """What a long mint tells its operator: first this machine's measured hash rate and an honest estimate
    (a mint is a lottery: the time is exponential, 1 mint in 20 takes 3x the mean), then progress every
    PROGRESS_EVERY_S. Measured, not assumed: a rate written down on one machine was off by 10x on a
    machine whose cores were busy."""

    def __init__(self, difficulty: int, start: int, clock: Callable[[], float] = time.monotonic):
        self.difficulty, self.start, self.clock = difficulty, start, clock
        self.expected = 2.0**difficulty  # hashes, on average
        self.t0 = clock()
        self.next_log = self.t0 + RATE_PROBE_S
        self.estimated = False

    def tick(self, counter: int) -> None:
        now = self.clock()
        if now < self.next_log:
            return
        self.next_log = now + PROGRESS_EVERY_S
        done, elapsed = counter - self.start, now - self.t0
        rate = done / max(elapsed, 1e-9)
        if not self.estimated:
            self.estimated = True
            mean = self.expected / max(rate, 1.0)
            resumed = f", going on from {counter / 1e6:.1f} M hashes tried before" if self.start else ""
            logger.info(
                "minting this key's proof of work (%d bits, once%s): %.2f M hashes/s measured on this "
                "machine, so about %s on average; it is a lottery: 1 mint in 20 takes over %s. Progress "
                "every %.0f s; a stop keeps what was tried",
                self.difficulty,
                resumed,
                rate / 1e6,
                duration(mean),
                duration(3 * mean),
                PROGRESS_EVERY_S,
            )
            return
        logger.info(
            "proof of work: %.1f M hashes tried (%.0f%% of the average %.1f M) in %s at %.2f M/s; still searching",
            counter / 1e6,
            100 * counter / self.expected,
            self.expected / 1e6,
            duration(elapsed),
            rate / 1e6,
        )

    def done(self, counter: int) -> None:
        if self.estimated:
            elapsed = duration(self.clock() - self.t0)
            logger.info("proof of work found after %.1f M hashes in %s", counter / 1e6, elapsed)


def duration(seconds: float) -> str:
    """`42 s`, `3 min 10 s`, `2 h 05 min`: an estimate a person reads."""
    s = int(round(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def mint_pow(
    public_key: bytes, difficulty: int, should_stop: Callable[[], bool] | None = None, start: int = 0
) -> bytes:
    """Search nonces start, start + 1, ... until one proves `difficulty` bits (2**difficulty hashes on average).
    Every CHUNK hashes `should_stop` is asked (MintStopped when it says yes) and, from LOG_FROM_BITS bits,
    the meter may log (MintMeter)."""
    if not 0 <= difficulty <= MAX_POW_DIFFICULTY:
        raise ValueError(f"difficulty must be in [0, {MAX_POW_DIFFICULTY}]")
    prefix = hashlib.sha256(POW_DOMAIN + public_key)
    full_bytes, rest_bits = divmod(difficulty, 8)
    zeros = bytes(full_bytes)
    limit = 1 << (8 - rest_bits)  # the byte after the zero bytes must be below this
    meter = MintMeter(difficulty, start) if difficulty >= LOG_FROM_BITS else None
    counter = start
    while True:
        for candidate in range(counter, counter + CHUNK):
            nonce = candidate.to_bytes(NONCE_LEN, "big")
            h = prefix.copy()
            h.update(nonce)
            d = h.digest()
            if d[:full_bytes] == zeros and (rest_bits == 0 or d[full_bytes] < limit):
                if meter is not None:
                    meter.done(candidate + 1)
                return nonce
        counter += CHUNK  # the next chunk's first nonce: every nonce below it was tried
        if should_stop is not None and should_stop():
            raise MintStopped(counter)
        if meter is not None:
            meter.tick(counter)


def load_or_mint_pow(
    path: Path, public_key: bytes, difficulty: int, should_stop: Callable[[], bool] | None = None
) -> bytes:
    """The nonce stored at `path` if it still proves `difficulty`, else a new one (written atomically, 0600).
    A mint stopped by `should_stop` leaves its progress beside it (`<path>.progress`): the next mint of
    this key goes on from there instead of trying the same nonces again (then MintStopped goes on up)."""
    path = Path(path)
    if path.exists():
        try:
            nonce = bytes.fromhex(path.read_text().strip())
        except (OSError, ValueError) as e:
            raise PowError(f"proof-of-work file {path} is unreadable or corrupt: {e}") from e
        if len(nonce) != NONCE_LEN:
            raise PowError(f"proof-of-work file {path} is corrupt: expected {NONCE_LEN} hex bytes")
        if check_pow(public_key, nonce, difficulty):
            return nonce
    progress = path.with_name(path.name + ".progress")
    start = _tried(progress, public_key, difficulty)
    try:  # missing, or minted for less work than asked (swarm or tier)
        nonce = mint_pow(public_key, difficulty, should_stop, start)
    except MintStopped as stopped:
        write_atomically(progress, f"{public_key.hex()} {difficulty} {stopped.next_counter}\n")
        raise
    write_atomically(path, nonce.hex() + "\n")
    progress.unlink(missing_ok=True)
    return nonce


def _tried(progress: Path, public_key: bytes, difficulty: int) -> int:
    """Nonces a stopped mint of this key already tried in vain (0 if none, or the file is not for this mint).
    Valid for the same or more bits: a nonce that failed fewer bits fails more."""
    try:
        key, bits, counter = progress.read_text().split()
        if key == public_key.hex() and int(bits) <= difficulty:
            tried = int(counter)
            return tried if 0 <= tried < 1 << (8 * NONCE_LEN) else 0  # past the nonce space: not this mint's
    except (OSError, ValueError):
        pass
    return 0
