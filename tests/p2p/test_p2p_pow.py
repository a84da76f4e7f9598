"""Proof-of-work identities: minted once, stored beside the key, re-minted only when the swarm asks for more."""

import time

import pytest

from p2p.identity import KEY_FILENAME, Identity, IdentityError
from p2p.pow import POW_FILENAME, check_pow, leading_zero_bits, mint_pow, pow_digest


def test_leading_zero_bits():
    assert leading_zero_bits(b"\x00\x00\x01") == 23
    assert leading_zero_bits(b"\x80") == 0
    assert leading_zero_bits(b"\x0f\xff") == 4
    assert leading_zero_bits(b"\x00") == 8


def test_mint_and_check():
    key = Identity.generate().public_key_bytes
    nonce = mint_pow(key, 12)
    assert leading_zero_bits(pow_digest(key, nonce)) >= 12
    assert check_pow(key, nonce, 12)
    other = Identity.generate().public_key_bytes
    assert not check_pow(other, nonce, 12) or leading_zero_bits(pow_digest(other, nonce)) >= 12
    assert not check_pow(key, nonce[:-1], 12)  # wrong length
    assert check_pow(key, b"", 0)  # difficulty 0: no work asked


def test_nonce_is_created_once_and_persisted(tmp_path):
    path = tmp_path / KEY_FILENAME
    a = Identity.load_or_create(path, create=True, pow_difficulty=10)
    stored = (tmp_path / POW_FILENAME).read_text()
    assert check_pow(a.public_key_bytes, a.pow_nonce, 10)
    assert (tmp_path / POW_FILENAME).stat().st_mode & 0o777 == 0o600
    mtime = (tmp_path / POW_FILENAME).stat().st_mtime_ns
    b = Identity.load_or_create(path, create=False, pow_difficulty=10)
    assert (b.public_key_bytes, b.pow_nonce) == (a.public_key_bytes, a.pow_nonce)
    assert (tmp_path / POW_FILENAME).read_text() == stored and (tmp_path / POW_FILENAME).stat().st_mtime_ns == mtime
    c = Identity.load_or_create(path, create=False, pow_difficulty=14)  # the swarm raised its difficulty
    assert c.public_key_bytes == a.public_key_bytes and check_pow(c.public_key_bytes, c.pow_nonce, 14)


def test_corrupt_nonce_file_is_a_clear_error(tmp_path):
    Identity.load_or_create(tmp_path / KEY_FILENAME, create=True, pow_difficulty=4)
    (tmp_path / POW_FILENAME).write_text("zz-not-hex")
    with pytest.raises(IdentityError, match="proof-of-work file"):
        Identity.load_or_create(tmp_path / KEY_FILENAME, create=False, pow_difficulty=4)


def test_mint_time_at_16_bits_is_seconds_not_minutes():
    """Prints the figure; the default (20 bits) is measured in docs/BENCHMARKS.md."""
    start = time.perf_counter()
    ident = Identity.generate(16)
    assert check_pow(ident.public_key_bytes, ident.pow_nonce, 16)
    print(f"minted a 16-bit identity in {time.perf_counter() - start:.2f}s")
