"""Multiaddr syntax (p2p/maddr.py): a typo is one line before anything starts, a real address passes."""

import pytest

from bootstrap.main import main, parse_args, usage_problem
from p2p.maddr import first_problem, problem

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


@pytest.mark.parametrize(
    "maddr",
    [
        "/ip4/0.0.0.0/tcp/0",
        f"/ip4/10.0.0.5/tcp/31337/p2p/{PEER}",
        "/ip6/::1/tcp/31337",
        "/dns/boot.example.org/tcp/31337/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN",
        "/ip4/1.2.3.4/udp/4001/quic-v1",
        f"/ip4/1.2.3.4/tcp/4001/p2p/{PEER}/p2p-circuit",
        "/ip4/1.2.3.4/tcp/31337/p2p/bafzaajaiaejcal72gwuz2or47oyxxn6b3rkwdmmkrxgkjxzy3rqt5kczyn7lcm3l",  # CIDv1
        "/ip6zone/eth0/ip6/fe80::1/tcp/31337",
        "/unix/tmp/p2pd.sock",
    ],
)
def test_addresses_libp2p_takes_pass(maddr):
    assert problem(maddr) is None


@pytest.mark.parametrize(
    "maddr, why",
    [
        ("foo", "starts with '/'"),
        ("localhost:1234", "starts with '/'"),
        ("/ip4/999.0.0.1/tcp/0", "not an IPv4 address"),
        ("/ip6/1.2.3.4/tcp/0", "not an IPv6 address"),
        ("/ip4/1.2.3.4/tcp/70000", "not a port"),
        ("/ip4/1.2.3.4/tcp/x", "not a port"),
        ("/ip4/1.2.3.4/tcp/\u00b2", "not a port"),  # a Unicode digit int() refuses
        ("/ip4/1.2.3.4/tcp/" + "1" * 5000, "not a port"),
        ("/ip4/1.2.3.4/tcp", "/tcp needs a value"),
        ("/ip4/1.2.3.4/tcpp/5", "unknown protocol 'tcpp'"),
        ("/dns/-bad-/tcp/1", "not a host name"),
        ("/ip4/1.2.3.4/tcp/1/p2p/0OIl", "not a peer id"),
    ],
)
def test_malformed_addresses_say_what_is_wrong(maddr, why):
    assert why in (problem(maddr) or "")


def test_the_rules_for_peers_and_listen_addresses():
    assert "no peer id" in first_problem("--peers", ["/ip4/1.2.3.4/tcp/31337"], need_peer_id=True)
    assert first_problem("--peers", [f"/ip4/1.2.3.4/tcp/31337/p2p/{PEER}"], need_peer_id=True) is None
    line = first_problem("--host-maddrs", ["/ip4/0.0.0.0/tcp/0", f"/ip4/0.0.0.0/tcp/0/p2p/{PEER}"], allow_peer_id=False)
    assert (
        line.startswith("--host-maddrs: a listen address names no peer id") and "(got '/ip4/0.0.0.0/tcp/0/p2p/" in line
    )


def test_the_bootstrap_peer_refuses_a_malformed_address_with_exit_2(capsys):
    assert usage_problem(parse_args(["--host-maddrs", "/ip4/127.0.0.1/tcp/0"])) is None
    assert main(["--announce-maddrs", "/ip4/1.2.3/tcp/31337"]) == 2  # before the DHT starts
    assert "--announce-maddrs: /ip4/1.2.3 is not an IPv4 address" in capsys.readouterr().err
