"""Protocol minor 1: a group's optional "logp_mean" (the publisher's mean token log-prob per completion). Checked
like every other member; a batch of an older peer (p2p/ before minor 1, from git history) still verifies here, and
ours verifies there."""

from __future__ import annotations

import base64
import subprocess
import sys
import textwrap

import pytest
from test_p2p_wire import make_batch, payload_of, reason_of

from conftest import REPO
from p2p.identity import Identity
from p2p.wire import MIN_LOGP_MEAN, canonical_json, decode_signed, encode_signed, seal

ME = Identity.generate()


def with_logp(values_per_group):
    batch = make_batch(groups=len(values_per_group), completions=3, ident=ME)
    for g, values in zip(batch.groups, values_per_group):
        g.logp_mean = values
    return batch


def test_logp_mean_round_trips_rounded_and_costs_a_few_bytes_a_completion():
    batch = with_logp([[-0.123456789, -2.0, 0.0], None])
    data = encode_signed(batch, ME)
    got = decode_signed(data)
    assert got.groups[0].logp_mean == [-0.1235, -2.0, 0.0]
    assert got.groups[1].logp_mean is None
    assert payload_of(data)["minor"] == 1
    plain = encode_signed(with_logp([None, None]), ME)
    assert 0 < len(data) - len(plain) <= 3 * 10 + len('"logp_mean":[],')


@pytest.mark.parametrize(
    "bad",
    [
        [-0.1, -0.2],
        [-0.1, -0.2, 0.5],
        [-0.1, -0.2, MIN_LOGP_MEAN - 1],
        [-0.1, "x", 0.0],
        {"a": 1},
        [-0.1, None, -0.3],
        [True, -0.2, -0.3],
    ],
)
def test_a_malformed_logp_mean_is_schema(bad):
    obj = payload_of(encode_signed(with_logp([[-0.1, -0.2, -0.3]]), ME))
    obj["groups"][0]["logp_mean"] = bad
    assert reason_of(seal(canonical_json(obj), ME)) == "schema"


def test_an_honest_node_cannot_sign_a_malformed_logp_mean():
    with pytest.raises(ValueError, match="logp_mean"):
        encode_signed(with_logp([[-0.1, 0.2, -0.3]]), ME)


_OLD_PEER = textwrap.dedent("""
    import base64, sys, time
    from p2p.identity import Identity
    from p2p.wire import WIRE_VERSION, RolloutBatch, TaskSpecWire, WireGroup, decode_signed, encode_signed
    assert not hasattr(sys.modules["p2p.wire"], "WIRE_MINOR")
    theirs = decode_signed(base64.b64decode(sys.argv[1]))   # our minor-1 batch, read by the older decoder
    print("READ", len(theirs.groups), theirs.groups[0].completions[0][:2])
    me = Identity.generate()
    group = WireGroup(TaskSpecWire("basic_arithmetic", {}, 1, 0), ["2", "3"], [1.0, 0.0])
    batch = RolloutBatch(WIRE_VERSION, "test", 3, me.public_key_bytes, time.time(), "m", [group])
    print("SENT", base64.b64encode(encode_signed(batch, me)).decode())
""")


def _tree_before_minor(tmp) -> str:
    """p2p/ as it was before minor 1 (the parent of the commit that brought WIRE_MINOR), or HEAD's if no commit
    has it yet (the change is not committed)."""
    found = subprocess.run(
        ["git", "-C", str(REPO), "log", "--format=%H", "-S", "WIRE_MINOR", "--", "p2p/wire.py"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if not found:
        head = subprocess.run(
            ["git", "-C", str(REPO), "show", "HEAD:p2p/wire.py"], capture_output=True, text=True, check=False
        )
        if head.returncode != 0 or "WIRE_MINOR" in head.stdout:
            pytest.skip("the protocol before minor 1 is not in this checkout's git history")
    rev = found[-1] + "^" if found else "HEAD"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "p2p"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    return str(tmp)


def test_older_peers_and_minor_one_read_each_other(tmp_path):
    old_tree = _tree_before_minor(tmp_path)
    ours = encode_signed(with_logp([[-0.5, -1.5, -0.25]]), ME)
    out = subprocess.run(
        [sys.executable, "-c", _OLD_PEER, base64.b64encode(ours).decode()],
        cwd=old_tree,
        env={"PYTHONPATH": old_tree, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["READ"] == "1 éé"
    theirs = decode_signed(base64.b64decode(lines["SENT"]))
    assert theirs.groups[0].logp_mean is None and theirs.groups[0].rewards == [1.0, 0.0]
