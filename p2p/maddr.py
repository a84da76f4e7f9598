"""The syntax of a multiaddr, checked before a node starts (hivemind-free, so a typo costs no model load).

hivemind hands a malformed address to its forked DHT process, whose parse error cannot travel back: the
start then times out a minute later with a hint about unreachable peers. What is checked here: each
protocol is one libp2p knows, and its value parses (an IP, a port, a host name, a base58 peer id).
"""

from __future__ import annotations

import ipaddress
import re

PORT_PROTOCOLS = ("tcp", "udp", "dccp", "sctp")
HOST_PROTOCOLS = ("dns", "dns4", "dns6", "dnsaddr")
PEER_PROTOCOLS = ("p2p", "ipfs")
VALUELESS = (
    "quic", "quic-v1", "ws", "wss", "p2p-circuit", "tls", "noise", "webtransport", "webrtc", "webrtc-direct",
    "utp", "udt", "http", "https", "p2p-webrtc-star", "p2p-websocket-star", "p2p-stardust",
)  # fmt: skip
OTHER_VALUED = ("ip6zone", "ipcidr", "onion", "onion3", "garlic32", "garlic64", "certhash", "sni", "memory")
VALUED = ("ip4", "ip6", *PORT_PROTOCOLS, *HOST_PROTOCOLS, *PEER_PROTOCOLS, *OTHER_VALUED)
EXAMPLE = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."

_HOST = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
_PEER_ID = re.compile(  # base58btc: "12D3KooW..." (52), "Qm..." (46); CIDv1 in base32 ("bafz...") or base36 ("k51...")
    r"[1-9A-HJ-NP-Za-km-z]{30,128}|b[a-z2-7]{30,128}|k[0-9a-z]{30,128}"
)
_PORT = re.compile(r"[0-9]{1,5}")  # ASCII digits only: str.isdigit() takes '²', which int() refuses


def problem(maddr: str, need_peer_id: bool = False, allow_peer_id: bool = True) -> str | None:
    """What is wrong with `maddr`, in a few words; None when it parses."""
    if not maddr.startswith("/") or maddr == "/":
        return "a multiaddr starts with '/' and names a protocol"
    parts = maddr[1:].rstrip("/").split("/")
    seen: list[str] = []
    i = 0
    while i < len(parts):
        proto = parts[i]
        if proto in VALUELESS:
            seen.append(proto)
            i += 1
            continue
        if proto == "unix":  # a path: the rest of the address
            if i + 1 >= len(parts):
                return "/unix needs a path"
            seen.append(proto)
            break
        if proto not in VALUED:
            return f"unknown protocol {proto!r}"
        if i + 1 >= len(parts) or not parts[i + 1]:
            return f"/{proto} needs a value"
        why = _value_problem(proto, parts[i + 1])
        if why:
            return why
        seen.append(proto)
        i += 2
    has_peer_id = any(p in PEER_PROTOCOLS for p in seen)
    if need_peer_id and not has_peer_id:
        return "no peer id: a peer's address ends in /p2p/<its id> (its log's 'DHT peer ... up at' line has it)"
    if not allow_peer_id and has_peer_id:
        return "a listen address names no peer id (/p2p/...)"
    return None


def _value_problem(proto: str, value: str) -> str | None:
    if proto in ("ip4", "ip6"):
        try:
            (ipaddress.IPv4Address if proto == "ip4" else ipaddress.IPv6Address)(value)
        except ValueError:
            return f"/{proto}/{value} is not an IPv{proto[-1]} address"
    elif proto in PORT_PROTOCOLS:
        if not _PORT.fullmatch(value) or int(value) > 65535:
            return f"/{proto}/{value} is not a port (0-65535)"
    elif proto in HOST_PROTOCOLS:
        if not _HOST.fullmatch(value):
            return f"/{proto}/{value} is not a host name"
    elif proto in PEER_PROTOCOLS and not _PEER_ID.fullmatch(value):
        return f"/{proto}/{value} is not a peer id (base58, like 12D3KooW...)"
    return None


def first_problem(flag: str, maddrs: list[str], **rules: bool) -> str | None:
    """One line naming the flag and the first address that does not parse; None when all do."""
    for maddr in maddrs:
        why = problem(str(maddr), **rules)
        if why:
            return f"{flag}: {why} (got {str(maddr)!r}; a multiaddr looks like {EXAMPLE})"
    return None


def flags_problem(peers: list[str], host_maddrs: list[str], announce_maddrs: list[str]) -> str | None:
    """The address flags' rules, for sapo-node and sapo-bootstrap alike: a peer names its id, a listen address
    does not, an announced one may."""
    return (
        first_problem("--peers", peers, need_peer_id=True)
        or first_problem("--host-maddrs", host_maddrs, allow_peer_id=False)
        or first_problem("--announce-maddrs", announce_maddrs)
    )
