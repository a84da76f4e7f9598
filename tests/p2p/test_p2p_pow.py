"""Proof-of-work identities: minted once, stored beside the key, re-minted only when the swarm asks for more."""

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
    # the work is bound to the key: the same nonce proves nothing for other keys (fixed keys, so this is
    # not left to chance: each has a 1 in 4096 chance to pass by luck, and none of these does)
    others = [bytes([i]) * 32 for i in range(64)]
    fixed = mint_pow(bytes(range(32)), 12)
    assert check_pow(bytes(range(32)), fixed, 12)
    assert not any(check_pow(o, fixed, 12) for o in others)
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


def test_a_mint_takes_about_two_to_the_difficulty_hashes():
    """What the time to mint rests on (the seconds themselves are measured in docs/BENCHMARKS.md, not
    here): the nonce is the first counter value whose hash has the bits, so it counts the hashes tried,
    and over 48 fixed keys the mean count at 8 bits is 2**8 within a factor of two."""
    tries = []
    for i in range(48):
        key = bytes([i, 7]) * 16
        nonce = mint_pow(key, 8)
        n = int.from_bytes(nonce, "big")
        assert check_pow(key, nonce, 8) and not any(check_pow(key, k.to_bytes(8, "big"), 8) for k in range(n))
        tries.append(n + 1)
    assert 2**7 < sum(tries) / len(tries) < 2**9, sum(tries) / len(tries)
    assert check_pow(bytes(32), mint_pow(bytes(32), 16), 16)  # and near the default's difficulty too


def test_a_stopped_mint_goes_on_where_it_stopped_and_finds_the_same_nonce(tmp_path):
    """The search is deterministic (nonces 0, 1, 2, ...): a stopped mint keeps how far it got, and the next
    mint of that key starts there and finds the nonce an uninterrupted mint finds."""
    from p2p.pow import CHUNK, MintStopped, load_or_mint_pow

    key = next(
        k for k in (bytes([i]) * 32 for i in range(256)) if int.from_bytes(mint_pow(k, 14), "big") > 2 * CHUNK
    )  # a key whose nonce lies past 2 chunks
    straight = mint_pow(key, 14)
    path = tmp_path / POW_FILENAME
    asked = []
    with pytest.raises(MintStopped) as stopped:
        load_or_mint_pow(path, key, 14, should_stop=lambda: asked.append(1) or len(asked) >= 2)
    assert stopped.value.next_counter == 2 * CHUNK and not path.exists()
    assert (tmp_path / f"{POW_FILENAME}.progress").read_text().split() == [key.hex(), "14", str(2 * CHUNK)]
    assert load_or_mint_pow(path, key, 14) == straight
    assert not (tmp_path / f"{POW_FILENAME}.progress").exists()
    # progress of another key, or of fewer bits than asked... is for another search: it starts at 0
    from p2p.pow import _tried

    (tmp_path / "p").write_text(f"{key.hex()} 14 {2 * CHUNK}\n")
    assert _tried(tmp_path / "p", key, 16) == 2 * CHUNK  # a nonce that failed 14 bits fails 16
    assert _tried(tmp_path / "p", key, 12) == 0
    assert _tried(tmp_path / "p", bytes(32), 14) == 0
    (tmp_path / "p").write_text(f"{key.hex()} 14 {2**64}\n")  # past the nonce space: a corrupt file, ignored
    assert _tried(tmp_path / "p", key, 14) == 0


def test_the_mint_estimate_comes_from_the_measured_rate(caplog):
    """What a long mint says: the rate it measured, the mean time at that rate and the 1-in-20 time (3x), then
    progress at least every 10 s."""
    import logging

    from p2p.pow import MintMeter

    now = [100.0]
    meter = MintMeter(24, 0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="p2p.pow")
    meter.tick(100_000)  # before the rate is measured: silent
    now[0] += 0.8
    meter.tick(800_000)  # 1.0 M hashes/s
    now[0] += 10.0
    meter.tick(10_800_000)
    first, progress = (r.getMessage() for r in caplog.records)
    assert "1.00 M hashes/s measured on this machine, so about 17 s on average" in first
    assert "1 mint in 20 takes over 50 s" in first
    assert progress.startswith("proof of work: 10.8 M hashes tried (64% of the average 16.8 M) in 11 s")
