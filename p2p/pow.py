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
from pathlib import Path

from p2p.files import write_atomically

logger = logging.getLogger(__name__)

POW_DOMAIN = b"sapo-pow-v1\x00"
NONCE_LEN = 8
DEFAULT_POW_DIFFICULTY = 20  # ~1 s to mint on one core of the development machine (docs/BENCHMARKS.md)
MAX_POW_DIFFICULTY = 40
POW_FILENAME = "identity.pow"
TIER_BITS = 4  # extra bits per work tier: each tier costs 16x the swarm's mint
MAX_TIER = 3


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


def mint_pow(public_key: bytes, difficulty: int) -> bytes:
    """Search nonces 0, 1, 2, ... until one proves `difficulty` bits (2**difficulty hashes on average)."""
    if not 0 <= difficulty <= MAX_POW_DIFFICULTY:
        raise ValueError(f"difficulty must be in [0, {MAX_POW_DIFFICULTY}]")
    prefix = hashlib.sha256(POW_DOMAIN + public_key)
    full_bytes, rest_bits = divmod(difficulty, 8)
    zeros = bytes(full_bytes)
    limit = 1 << (8 - rest_bits)  # the byte after the zero bytes must be below this
    counter = 0
    while True:
        nonce = counter.to_bytes(NONCE_LEN, "big")
        h = prefix.copy()
        h.update(nonce)
        d = h.digest()
        if d[:full_bytes] == zeros and (rest_bits == 0 or d[full_bytes] < limit):
            return nonce
        counter += 1


def load_or_mint_pow(path: Path, public_key: bytes, difficulty: int) -> bytes:
    """The nonce stored at `path` if it still proves `difficulty`, else a new one (written atomically, 0600)."""
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
    if difficulty >= 16:
        logger.info("minting this key's proof of work (%d bits, about %.0f s on one core, once)", difficulty,
                    2.0 ** (difficulty - 20))
    nonce = mint_pow(public_key, difficulty)  # missing, or minted for less work than asked (swarm or tier)
    write_atomically(path, nonce.hex() + "\n")
    return nonce
