"""Benchmark the swarm gossip layer on loopback, or summarize swarm I/O share from run metrics.

    python -m scripts.bench.gossip --peers 8 --samples 40
    python -m scripts.bench.gossip --metrics runs/node0 runs/node1

Peers are real hivemind DHT processes on 127.0.0.1 (one forked DHT + one p2pd each), started
from this process. "publish->visible" is the time from the start of publish() on one peer until
another peer's DHT get of that batch key returns the publisher's entry. Keys are minted at 8 bits of
proof of work. For swarm sizes beyond what one machine can run as real peers, see scripts/bench/scale.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

from p2p.identity import SIGNATURE_LEN, Identity
from p2p.transport import SwarmTransport, TransportConfig
from p2p.validators import batch_key, owner_of_subkey
from p2p.wire import HEADER_LEN, WIRE_VERSION, RolloutBatch, TaskSpecWire, WireGroup, decode_signed, encode_signed

SWARM = "bench"


def realistic_batch(ident: Identity, rnd: int, groups: int, completions: int, chars: int) -> RolloutBatch:
    rng = random.Random(rnd)
    alphabet = string.ascii_letters + string.digits + "   .,+-*/=()"
    return RolloutBatch(
        version=WIRE_VERSION, swarm=SWARM, round=rnd, publisher=ident.public_key_bytes, created_at=time.time(),
        model="Qwen2.5-0.5B-Instruct",
        groups=[
            WireGroup(
                task=TaskSpecWire("basic_arithmetic", {"min_terms": 2, "max_terms": 6}, 1234, rnd * 64 + g),
                completions=["".join(rng.choices(alphabet, k=chars)) for _ in range(completions)],
                rewards=[float(rng.random() < 0.5) for _ in range(completions)],
            )
            for g in range(groups)
        ],
    )  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def crypto_costs(args: argparse.Namespace) -> None:
    ident = Identity.generate()
    batch = realistic_batch(ident, 1, args.groups, args.completions, args.chars)
    n = 50
    t = time.perf_counter()
    for _ in range(n):
        data = encode_signed(batch, ident)
    enc = (time.perf_counter() - t) / n * 1e3
    t = time.perf_counter()
    for _ in range(n):
        decode_signed(data)
    dec = (time.perf_counter() - t) / n * 1e3
    t = time.perf_counter()
    for _ in range(n):
        Identity.verify(ident.public_key_bytes, data[HEADER_LEN:], data[HEADER_LEN - SIGNATURE_LEN : HEADER_LEN])
    ver = (time.perf_counter() - t) / n * 1e3
    print(f"batch: {args.groups} groups x {args.completions} completions x {args.chars} chars = {len(data)} bytes")
    print(f"encode+sign {enc:.2f} ms/batch | verify+decode {dec:.2f} ms/batch (signature alone {ver:.3f} ms)")


async def wait_visible(observer: SwarmTransport, key: str, publisher: bytes, timeout: float) -> float | None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        result = await observer.dht.get(key, latest=True, return_future=True)
        if result is not None and isinstance(result.value, dict):
            if any(owner_of_subkey(sk) == publisher for sk in result.value):
                return time.perf_counter()
        await asyncio.sleep(0.005)
    return None


async def network_bench(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_gossip_"))
    loop = ["/ip4/127.0.0.1/tcp/0"]

    def cfg(i: int, peers: list[str]) -> TransportConfig:
        return TransportConfig(identity_dir=tmp / f"p{i}", swarm=SWARM, host_maddrs=loop, initial_peers=peers,
                               fetch_timeout_s=30, publish_timeout_s=30, pow_difficulty=8)  # fmt: skip

    t0 = time.perf_counter()
    first = SwarmTransport(cfg(0, []))
    await first.start()
    peers = [first]
    rest = [SwarmTransport(cfg(i, first.visible_maddrs())) for i in range(1, args.peers)]
    for i in range(0, len(rest), 8):  # start in waves: p2pd start-up is CPU bound
        await asyncio.gather(*(t.start() for t in rest[i : i + 8]))
    peers += rest
    print(f"{args.peers} peers up in {time.perf_counter() - t0:.1f}s")
    try:
        publish_s, visible_s, missed = [], [], 0
        for s in range(args.samples):
            i = s % len(peers)
            j = (i + 1 + s // len(peers)) % len(peers)
            j = j if j != i else (i + 1) % len(peers)
            pub, obs, rnd = peers[i], peers[j], 1 + s
            fresh = realistic_batch(pub.identity, rnd, args.groups, args.completions, args.chars)
            data = encode_signed(fresh, pub.identity)
            t = time.perf_counter()
            ok = await pub.publish(rnd, data)
            publish_s.append(time.perf_counter() - t)
            seen = await wait_visible(
                obs, batch_key(SWARM, pub.identity.public_key_bytes, rnd), pub.identity.public_key_bytes, 10.0
            )
            if not ok or seen is None:
                missed += 1
                continue
            visible_s.append(seen - t)
        ms = lambda xs, q: pct(xs, q) * 1e3  # noqa: E731
        print(f"publish() p50 {ms(publish_s, 50):.0f} ms  p99 {ms(publish_s, 99):.0f} ms  ({len(publish_s)} samples)")
        if visible_s:
            p50, p99 = ms(visible_s, 50), ms(visible_s, 99)
            print(f"publish->visible p50 {p50:.0f} ms  p99 {p99:.0f} ms  (missed {missed})")
        # a full fetch() from one peer: sampled presence shards + at most fetch_max batch keys
        t = time.perf_counter()
        got = await peers[-1].fetch()
        dt = time.perf_counter() - t
        nbytes = sum(len(r.data) for r in got)
        print(f"fetch(): {len(got)} records from {len(peers[-1].known_peers())} peers, "
              f"{nbytes / 1e6:.2f} MB in {dt * 1e3:.0f} ms")  # fmt: skip
    finally:
        await asyncio.gather(*(p.shutdown() for p in peers))


def metrics_mode(run_dirs: list[str]) -> None:
    total_io = total_round = 0.0
    for d in run_dirs:
        path = Path(d) / "metrics.jsonl" if Path(d).is_dir() else Path(d)
        io, rs, shares = 0.0, 0.0, []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                a, b = float(row["swarm_io_s"]), float(row["round_s"])
            except (ValueError, KeyError, TypeError):
                continue
            io, rs = io + a, rs + b
            if b > 0:
                shares.append(a / b)
        total_io, total_round = total_io + io, total_round + rs
        if shares:
            print(f"{path}: {len(shares)} rounds, swarm I/O {100 * io / rs:.1f}% of round time "
                  f"(per-round p50 {100 * statistics.median(shares):.1f}%, "
                  f"p99 {100 * pct(shares, 99):.1f}%)")  # fmt: skip
        else:
            print(f"{path}: no rows with swarm_io_s and round_s")
    if total_round > 0:
        print(f"all runs: swarm I/O {100 * total_io / total_round:.1f}% of {total_round:.0f} s round time")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--chars", type=int, default=300)
    p.add_argument("--metrics", nargs="+", metavar="RUN_DIR", help="summarize metrics.jsonl files instead")
    args = p.parse_args(argv)
    if args.metrics:
        metrics_mode(args.metrics)
        return 0
    crypto_costs(args)
    asyncio.run(network_bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
