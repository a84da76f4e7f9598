"""Identity: persistence, file mode, and loud failure instead of a silent new key."""

import os
import stat

import pytest

from p2p.identity import Identity, IdentityError, libp2p_identity_path


def test_create_then_load_same_key(tmp_path):
    path = tmp_path / "run" / "identity.ed25519"
    a = Identity.load_or_create(path, create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    b = Identity.load_or_create(path, create=False)
    assert a.public_key_bytes == b.public_key_bytes
    assert len(a.public_key_bytes) == 32
    assert a.peer_name == b.peer_name and a.peer_name.isalnum() and len(a.peer_name) == 16


def test_missing_key_without_create_is_an_error(tmp_path):
    path = tmp_path / "identity.ed25519"
    with pytest.raises(IdentityError, match=str(path)):
        Identity.load_or_create(path, create=False)
    assert not path.exists()


@pytest.mark.parametrize("content", [b"", b"garbage", b"x" * 33])
def test_corrupt_key_names_the_file_and_is_not_replaced(tmp_path, content):
    path = tmp_path / "identity.ed25519"
    path.write_bytes(content)
    with pytest.raises(IdentityError, match="corrupt") as err:
        Identity.load_or_create(path, create=True)
    assert str(path) in str(err.value)
    assert path.read_bytes() == content


def test_unreadable_key_is_an_error(tmp_path):
    path = tmp_path / "identity.ed25519"
    path.mkdir()  # a directory where the key should be: read fails on any uid, root included
    with pytest.raises(IdentityError, match=str(path)):
        Identity.load_or_create(path, create=True)


def test_sign_verify():
    ident, other = Identity.generate(), Identity.generate()
    sig = ident.sign(b"msg")
    assert Identity.verify(ident.public_key_bytes, b"msg", sig)
    assert not Identity.verify(ident.public_key_bytes, b"msg2", sig)
    assert not Identity.verify(other.public_key_bytes, b"msg", sig)
    assert not Identity.verify(b"short", b"msg", sig)
    assert not Identity.verify(ident.public_key_bytes, b"msg", sig[:-1])


def test_libp2p_identity_path_is_next_to_key(tmp_path):
    assert libp2p_identity_path(tmp_path) == tmp_path / "p2p.identity"


def test_a_write_that_fails_midway_leaves_no_key_file_and_a_retry_succeeds(tmp_path, monkeypatch):
    """A crash or a full disk while writing the key must not leave a short key file that fails every later
    start ('corrupt: got 0 bytes'): the final name appears only with the whole key behind it."""

    path = tmp_path / "identity.ed25519"
    real_fsync = os.fsync

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        Identity.load_or_create(path, create=True)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []  # no temp file left either
    monkeypatch.setattr(os, "fsync", real_fsync)
    a = Identity.load_or_create(path, create=True)
    assert len(path.read_bytes()) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load_or_create(path, create=False).public_key_bytes == a.public_key_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.ed25519", "identity.pow"]


def test_a_key_created_meanwhile_is_kept_not_overwritten(tmp_path, monkeypatch):
    path = tmp_path / "identity.ed25519"
    other = Identity.generate()
    real_link = os.link

    def racing_link(src, dst):  # another process's key lands between our check and our link
        path.write_bytes(other.private_bytes())
        real_link(src, dst)

    monkeypatch.setattr(os, "link", racing_link)
    got = Identity.load_or_create(path, create=True)
    assert got.public_key_bytes == other.public_key_bytes and path.read_bytes() == other.private_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.ed25519", "identity.pow"]


def test_without_hard_links_the_key_is_still_created_whole(tmp_path, monkeypatch):
    path = tmp_path / "identity.ed25519"

    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    a = Identity.load_or_create(path, create=True)
    assert len(path.read_bytes()) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load_or_create(path, create=False).public_key_bytes == a.public_key_bytes
