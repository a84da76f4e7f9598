"""write_atomically: the one atomic file write of p2p, the swarm's reputation table and the bootstrap."""

import os
import stat

import pytest

from p2p.files import write_atomically


def test_replaces_whole_file_private_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "state.json"
    write_atomically(path, "old\n")
    write_atomically(path, "new\n")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp(tmp_path):
    path = tmp_path / "state.json"
    write_atomically(path, "old\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(path, "\udcff")  # a lone surrogate cannot be encoded: fails inside the write
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
