"""Scale benchmark of the swarm exchange: what one honest node pays per round as the swarm grows.

    python -m scripts.bench.scale --publishers 10,100,1000 --json out.json
    python -m scripts.bench.scale --publishers 10,100,1000 --protocol old --json old.json

For each N: 8 DHT server peers (real hivemind DHT processes on 127.0.0.1), a few publisher DHT
clients that host N identities between them and publish one realistic ~20 KB signed batch plus a
presence record per identity every round, and one fetching node (a client-mode `SwarmTransport`).
Each round the fetcher runs `--samples` fetches, each as a node that has not seen the round yet.

Measured on the DHT servers themselves (every server process counts what it sends and receives):
bytes the fetching node received per fetch (protobuf size of every answer sent to its peer id), the
largest DHT message (a find answer or a store request, any peer), and fetch time p50/p99 and records
returned as seen by the fetcher. Identities are minted at a low proof-of-work difficulty (`--pow`,
default 8 bits) so that N = 1000 keys take no time; the cost of a real key is in docs/BENCHMARKS.md.

`--protocol old` runs protocol v1 (the commit before protocol v2, found in git history) from a
temporary `git archive` of its p2p/ package: no copy of the old transport lives in the tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial, wraps
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
OLD_MARK = "WIRE_VERSION = 1"  # the line protocol v2 removed from p2p/wire.py


# ------------------------------------------------------------------------------------ old protocol


def old_protocol_ref() -> str:
    """The parent of the newest commit that removed `WIRE_VERSION = 1` from p2p/wire.py."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "log", "--format=%H", "-S", OLD_MARK, "--", "p2p/wire.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not out:
        raise SystemExit("scripts.bench.scale: protocol v1 is not in this checkout's git history")
    return out[0] + "^"


def reexec_with_old_protocol(argv: list[str]) -> int:
    """Run this benchmark again with p2p/ of protocol v1 first on the import path."""
    ref = old_protocol_ref()
    with tempfile.TemporaryDirectory(prefix="sapo-p2p-v1-") as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "p2p"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([tmp, str(REPO), os.environ.get("PYTHONPATH", "")]),
            SAPO_BENCH_PROTOCOL_REF=ref,
        )
        short = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", ref], capture_output=True, text=True
        ).stdout.strip()
        print(f"protocol v1 from {ref} ({short}) in {tmp}", flush=True)
        # from the archive's directory: its p2p/ comes before the repository's on the import path
        return subprocess.run(
            [sys.executable, "-m", "scripts.bench.scale", *argv, "--_in-old"], env=env, cwd=tmp
        ).returncode


# ------------------------------------------------------------------------ metering inside DHT processes

_METER: dict[str, Any] = {"max_find": 0, "max_store": 0, "to_peer": Counter(), "finds": 0, "stores": 0}


def install_meter() -> None:
    """Count message sizes in every DHT process forked after this call (a benchmark-only patch)."""
    from hivemind.dht.protocol import DHTProtocol

    find, store = DHTProtocol.rpc_find, DHTProtocol.rpc_store

    @wraps(find)  # hivemind reads the handler's annotations
    async def rpc_find(self, request, context):
        response = await find(self, request, context)
        size = response.ByteSize()
        _METER["max_find"] = max(_METER["max_find"], size)
        _METER["to_peer"][str(context.remote_id)] += size
        _METER["finds"] += 1
        return response

    @wraps(store)
    async def rpc_store(self, request, context):
        _METER["max_store"] = max(_METER["max_store"], request.ByteSize())
        _METER["stores"] += 1
        return await store(self, request, context)

    DHTProtocol.rpc_find, DHTProtocol.rpc_store = rpc_find, rpc_store


async def _clear_cache(_dht, node) -> bool:
    """Forget values this node cached from earlier gets: each sample fetches like a node new to the round."""
    node.protocol.cache.clear()
    return True


async def _read_meter(_dht, _node) -> dict[str, Any]:
    return {**_METER, "to_peer": dict(_METER["to_peer"])}


# ----------------------------------------------------------------------------------------- workload


def realistic_batch(
    p2p_wire: Any, ident: Any, swarm: str, rnd: int, groups: int = 8, completions: int = 4, chars: int = 560
) -> bytes:
    """A signed batch of ~20 KB: `groups` tasks x `completions` completions of `chars` characters."""
    rng = random.Random(rnd * 7919 + ident.public_key_bytes[0])
    alphabet = string.ascii_letters + string.digits + "   .,+-*/=()"
    batch = p2p_wire.RolloutBatch(
        version=p2p_wire.WIRE_VERSION, swarm=swarm, round=rnd, publisher=ident.public_key_bytes,
        created_at=time.time(), model="Qwen2.5-0.5B-Instruct",
        groups=[p2p_wire.WireGroup(
            task=p2p_wire.TaskSpecWire("basic_arithmetic", {"min_terms": 2, "max_terms": 6}, 1234, rnd * 64 + g),
            completions=["".join(rng.choices(alphabet, k=chars)) for _ in range(completions)],
            rewards=[float(rng.random() < 0.5) for _ in range(completions)]) for g in range(groups)],
    )  # fmt: skip
    return p2p_wire.encode_signed(batch, ident)


async def _store_spilled(_dht, node, path: str) -> list[bool]:
    """Inside a publisher's DHT process: store every (key, subkey, value, expiration) pickled at `path`."""
    with open(path, "rb") as f:
        items = pickle.load(f)
    os.unlink(path)
    sem = asyncio.Semaphore(32)

    async def one(key, subkey, value, expiration) -> bool:
        async with sem:
            return bool(await node.store(key, value, expiration, subkey=subkey))

    return list(await asyncio.gather(*(one(*item) for item in items)))


class Protocol:
    """The few names that differ between protocol v1 and v2."""

    def __init__(self) -> None:
        from p2p import identity, transport, validators, wire

        self.identity, self.transport, self.validators, self.wire = identity, transport, validators, wire
        self.version = wire.WIRE_VERSION

    def new_identity(self, pow_bits: int) -> Any:
        return self.identity.Identity.generate(pow_bits) if self.version >= 2 else self.identity.Identity.generate()

    def keys(self, swarm: str, pub: bytes, rnd: int) -> tuple[str, str]:
        v = self.validators
        if self.version >= 2:
            shard = v.presence_shard(pub, v.DEFAULT_PRESENCE_SHARDS)
            return v.batch_key(swarm, pub, rnd), v.presence_key(swarm, shard)
        return v.round_key(swarm, rnd), v.presence_key(swarm)

    def validator(self, identities: list[Any], swarm: str, pow_bits: int) -> Any:
        v = self.validators
        if self.version >= 2:
            return v.SapoRecordValidator(
                identities[0], swarm, pow_difficulty=pow_bits, also_sign_for=tuple(identities[1:])
            )
        by_subkey = {v.MSGPackSerializer.dumps(v.owner_subkey(i.public_key_bytes)): i for i in identities}

        class MultiSigner(v.SapoRecordValidator):  # protocol v1 signs for one identity per DHT process
            def sign_value(self, record):
                signer = by_subkey.get(record.subkey)
                if signer is None:
                    return record.value
                msg = v.record_message(record.key, record.subkey, record.value, record.expiration_time)
                return record.value + v.RECORD_SIG_MAGIC + signer.sign(msg)

        return MultiSigner(identities[0], swarm)

    def transport_config(self, **kw: Any) -> Any:
        if self.version < 2:  # v1 reads the last `window` rounds of every peer; v2 has K and a proof of work
            for name in ("pow_difficulty", "fetch_max"):
                kw.pop(name, None)
            kw["window"] = 1
        return self.transport.TransportConfig(**kw)


# ------------------------------------------------------------------------------------------ one N


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def run_one(proto: Protocol, n: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import hivemind
    from hivemind.utils import get_dht_time

    swarm = f"bench-scale-{n}"
    servers: list[Any] = []
    publishers: list[Any] = []
    fetcher = None
    loop = asyncio.get_running_loop()
    t_setup = time.perf_counter()
    try:
        first = hivemind.DHT(
            start=True,
            host_maddrs=LOOPBACK,
            record_validators=[proto.validator([proto.new_identity(args.pow)], swarm, args.pow)],
        )
        servers.append(first)
        peers = [str(m) for m in first.get_visible_maddrs()]
        servers += [
            hivemind.DHT(
                initial_peers=peers,
                start=True,
                host_maddrs=LOOPBACK,
                await_ready=False,
                record_validators=[proto.validator([proto.new_identity(args.pow)], swarm, args.pow)],
            )
            for _ in range(args.servers - 1)
        ]
        for s in servers[1:]:
            await loop.run_in_executor(None, s.wait_until_ready, 60)
        identities = [proto.new_identity(args.pow) for _ in range(n)]
        groups = [identities[i :: args.publisher_procs] for i in range(min(n, args.publisher_procs))]
        publishers = [
            hivemind.DHT(
                initial_peers=peers,
                start=True,
                host_maddrs=LOOPBACK,
                client_mode=True,
                await_ready=False,
                record_validators=[proto.validator(g, swarm, args.pow)],
            )
            for g in groups
        ]
        for p in publishers:
            await loop.run_in_executor(None, p.wait_until_ready, 60)
        fcfg = proto.transport_config(
            identity_dir=tmp / f"fetcher-{n}",
            swarm=swarm,
            initial_peers=peers,
            host_maddrs=LOOPBACK,
            client_mode=True,
            fetch_timeout_s=args.fetch_timeout,
            pow_difficulty=args.pow,
            fetch_max=args.fetch_max,
        )
        fetcher = proto.transport.SwarmTransport(fcfg)
        await fetcher.start()
        fetcher_id = str(fetcher.dht.peer_id)
        setup_s = time.perf_counter() - t_setup

        times: list[float] = []
        bytes_per_fetch: list[int] = []
        records: list[int] = []
        publish_s: list[float] = []
        stored_ok = stored_total = 0
        for rnd in range(args.rounds):
            t0 = time.perf_counter()
            expiration = get_dht_time() + args.ttl
            futures = []
            for dht, group in zip(publishers, groups):
                items = []
                for ident in group:
                    pub = ident.public_key_bytes
                    bkey, pkey = proto.keys(swarm, pub, rnd)
                    subkey = proto.validators.owner_subkey(pub)
                    presence = proto.wire.encode_presence(
                        proto.wire.PresenceRecord(proto.version, swarm, pub, rnd, time.time()), ident
                    )
                    items.append((bkey, subkey, realistic_batch(proto.wire, ident, swarm, rnd), expiration))
                    items.append((pkey, subkey, presence, expiration))
                fd, path = tempfile.mkstemp(prefix="sapo-bench-", dir=tmp)
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(items, f)
                futures.append(dht.run_coroutine(partial(_store_spilled, path=path), return_future=True))
            results = await asyncio.gather(*futures)
            publish_s.append(time.perf_counter() - t0)
            stored_ok += sum(sum(r) for r in results)
            stored_total += sum(len(r) for r in results)
            for _ in range(args.samples):
                if hasattr(fetcher, "forget_fetched"):
                    fetcher.forget_fetched()  # each sample: a node that has not fetched this round yet
                await loop.run_in_executor(
                    None, lambda: fetcher.dht.run_coroutine(_clear_cache, return_future=True).result(30)
                )
                before = await _bytes_to(servers, fetcher_id)
                t1 = time.perf_counter()
                got = await fetcher.fetch()
                times.append(time.perf_counter() - t1)
                bytes_per_fetch.append(await _bytes_to(servers, fetcher_id) - before)
                records.append(len(got))
            print(
                f"  N={n} round {rnd}: publish {publish_s[-1]:.1f}s, fetch p50 {pct(times[-args.samples :], 50):.3f}s,"
                f" records {statistics.mean(records[-args.samples :]):.1f},"
                f" {statistics.mean(bytes_per_fetch[-args.samples :]) / 1024:.0f} KiB",
                flush=True,
            )
        meters = [
            await loop.run_in_executor(None, lambda d=d: d.run_coroutine(_read_meter, return_future=True).result(30))
            for d in (*servers, *publishers)
        ]
        return {
            "protocol": f"v{proto.version}",
            "publishers": n,
            "servers": args.servers,
            "rounds": args.rounds,
            "fetches": len(times),
            "fetch_p50_s": round(pct(times, 50), 4),
            "fetch_p99_s": round(pct(times, 99), 4),
            "fetch_bytes_per_round": round(statistics.mean(bytes_per_fetch)),
            "records_per_fetch": round(statistics.mean(records), 2),
            "max_message_bytes": max(max(m["max_find"], m["max_store"]) for m in meters),
            "max_find_answer_bytes": max(m["max_find"] for m in meters),
            "max_store_request_bytes": max(m["max_store"] for m in meters),
            "stores_ok": f"{stored_ok}/{stored_total}",
            "publish_round_s": round(statistics.mean(publish_s), 2),
            "setup_s": round(setup_s, 1),
            "fetch_max": args.fetch_max if proto.version >= 2 else None,
            "pow_bits": args.pow if proto.version >= 2 else None,
        }
    finally:
        if fetcher is not None:
            await fetcher.shutdown()
        for d in (*publishers, *servers):
            await loop.run_in_executor(None, d.shutdown)


async def _bytes_to(servers: list[Any], peer_id: str) -> int:
    loop = asyncio.get_running_loop()
    total = 0
    for d in servers:
        m = await loop.run_in_executor(None, lambda d=d: d.run_coroutine(_read_meter, return_future=True).result(30))
        total += m["to_peer"].get(peer_id, 0)
    return total


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--publishers", default="10,100,1000", help="comma-separated N values")
    p.add_argument("--protocol", choices=("new", "old"), default="new")
    p.add_argument("--json", type=Path, default=None, help="write the results here (a JSON list, one object per N)")
    p.add_argument("--servers", type=int, default=8)
    p.add_argument("--publisher-procs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--samples", type=int, default=10, help="fetches per round")
    p.add_argument("--fetch-max", type=int, default=16)
    p.add_argument("--fetch-timeout", type=float, default=5.0)
    p.add_argument("--pow", type=int, default=8, help="proof-of-work bits of the simulated identities")
    p.add_argument("--ttl", type=float, default=300.0)
    p.add_argument("--_in-old", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.protocol == "old" and not args._in_old:
        return reexec_with_old_protocol(argv)
    import logging

    logging.getLogger("hivemind").setLevel(logging.ERROR)
    install_meter()
    proto = Protocol()
    results = []
    with tempfile.TemporaryDirectory(prefix="sapo-bench-scale-") as tmp:
        for n in [int(x) for x in args.publishers.split(",")]:
            print(f"N={n} ({args.protocol} protocol, v{proto.version})", flush=True)
            res = asyncio.run(run_one(proto, n, args, Path(tmp)))
            print(json.dumps(res), flush=True)
            results.append(res)
            if args.json is not None:  # after every N: a long run that is stopped still leaves its figures
                args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
