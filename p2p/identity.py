"""Persistent Ed25519 identity of a swarm peer.

One key owns this peer's DHT records and signs its rollout batches, so losing or silently
replacing it would orphan everything the peer published. Hence: created only when the caller
allows it, stored with mode 0600, and any unreadable file is a hard error, never a fresh key.
"""

from __future__ import annotations

import base64
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p.files import fsync_dir
from p2p.pow import NONCE_LEN, POW_FILENAME, PowError, load_or_mint_pow, mint_pow

KEY_FILENAME = "identity.ed25519"
LIBP2P_IDENTITY_FILENAME = "p2p.identity"
PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64


class IdentityError(Exception):
    """The identity file is missing (when creation is not allowed), unreadable or corrupt."""


def libp2p_identity_path(identity_dir: Path) -> Path:
    """Path of hivemind's libp2p key next to ours; hivemind (p2pd) creates it when absent.

    Keeping it makes a restarted peer keep its peer id, hence its multiaddr.
    """
    return Path(identity_dir) / LIBP2P_IDENTITY_FILENAME


class Identity:
    """An Ed25519 signing key with a stable short name and its proof-of-work nonce (`p2p.pow`)."""

    def __init__(self, private_key: Ed25519PrivateKey, pow_nonce: bytes = bytes(NONCE_LEN)) -> None:
        self._key = private_key
        self._public = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.pow_nonce = pow_nonce

    @classmethod
    def generate(cls, pow_difficulty: int = 0) -> Identity:
        """A fresh in-memory identity with a nonce minted for `pow_difficulty` (tests, benchmarks)."""
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(key, mint_pow(public, pow_difficulty))

    @classmethod
    def load_or_create(
        cls,
        path: Path,
        create: bool,
        pow_difficulty: int = 0,
        pow_path: Path | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Identity:
        """Load the key at `path`; create it (mode 0600) only if missing and `create` is True.

        Its proof-of-work nonce lives in `pow_path` (default: beside it, `identity.pow`); minted once, or
        again only when the stored one is too weak for `pow_difficulty` (the swarm raised its difficulty).
        A mint asks `should_stop` as it goes: p2p.pow.MintStopped when it says yes (the key stays).
        """
        identity = cls._load_or_create_key(Path(path), create)
        pow_path = Path(path).parent / POW_FILENAME if pow_path is None else Path(pow_path)
        try:
            identity.pow_nonce = load_or_mint_pow(pow_path, identity.public_key_bytes, pow_difficulty, should_stop)
        except PowError as e:
            raise IdentityError(str(e)) from e
        return identity

    @classmethod
    def _load_or_create_key(cls, path: Path, create: bool) -> Identity:
        if not path.exists():
            if not create:
                raise IdentityError(f"identity key file {path} does not exist and creation was not allowed")
            return cls._create(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise IdentityError(f"cannot read identity key file {path}: {e}") from e
        if len(raw) != 32:
            raise IdentityError(f"identity key file {path} is corrupt: expected 32 raw bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    @classmethod
    def _create(cls, path: Path) -> Identity:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        # Whole or not at all: written and fsynced under a temp name beside it (mkstemp: 0600 from the first
        # byte), then hard-linked to the final name, which fails if that exists: never overwrites a key another
        # process created meanwhile, and a crash or a full disk mid-write leaves no short key file behind.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)  # umask may have narrowed it; make it exact (the link shares it)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # a file system without hard links: exclusive create of the final name instead
                cls._write_exclusive(path, raw)
            fsync_dir(path.parent)
        except FileExistsError:  # another process created it meanwhile: that key is the one
            return cls._load_or_create_key(path, create=False)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return cls(key)

    @staticmethod
    def _write_exclusive(path: Path, raw: bytes) -> None:
        """The key straight into `path` (O_EXCL, 0600); a failed write removes the short file it made."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        os.chmod(path, 0o600)  # umask may have narrowed it; make it exact

    @property
    def public_key_bytes(self) -> bytes:
        return self._public

    @property
    def public_key_hex(self) -> str:
        return self._public.hex()

    @property
    def peer_name(self) -> str:
        """Short printable id for logs: base32 of the first 10 pubkey bytes (16 chars)."""
        return peer_name_of(self._public)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def private_bytes(self) -> bytes:
        """Raw 32-byte seed (used to hand the key to the forked DHT process)."""
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @staticmethod
    def verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
        """True iff `signature` is a valid Ed25519 signature of `message` by `public_key`."""
        if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
        except (InvalidSignature, ValueError):
            return False
        return True


def peer_name_of(public_key: bytes) -> str:
    """Short printable name of any peer's public key (same scheme as Identity.peer_name)."""
    return base64.b32encode(public_key[:10]).decode().lower()
