"""Identity: persistence, file mode, and loud failure instead of a silent new key."""

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
