"""WAN benchmark: do external groups flow, and does the round wait, when peers are far apart?

    nice -n 10 python -m scripts.bench.wan --rtt-ms 0,10,50,150 --pipeline off,on --peers 3 --rounds 25 --json OUT

Each row is a fresh swarm on 127.0.0.1: a bootstrap peer and `--peers` real `sapo-node` peers (the tiny random
model, or `--model`'s on the cpu-learn mix; `--num-local`/`--num-external` 2/2 by default), each behind a relay
of the loopback WAN (scripts/bench/relay.py) that adds the row's round trip (half each way), `--jitter-ms`,
`--loss` (a stall of `--stall-ms` per lost chunk) and a `--bandwidth-mbit` cap; `--spread S` gives peer i a
delay (1 + S i/(N-1)) times the row's, so peers of one swarm differ. `--pipeline off` runs the nodes with
`--net-pipeline off`: the round of earlier versions, which awaits publish, fetch and verify in line; `on` runs
them behind the round. `--net-max-age` (comma-separated) gives the pipeline's rows their staleness bound (0, the
node's default: each round takes its own prefetch, waiting for what the fetch takes beyond generation; more:
rounds run on).

The peers run until each has finished `--rounds` rounds (or `--timeout-s`); rounds before `--warmup` are
left out (joining).

Per row: the mean and median round time; what the round waited on the network (the median of its fetch and
verify phases, and of its publish phase); what the network took (the median prefetch: fetch + verify, in line
or behind); external groups trained on per round against J and the share of rounds that got all J; their
median age in rounds and seconds; the rounds that waited at the staleness bound; bytes through the relays per
round. Every figure is over all peers' rounds together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench.procs import Proc, as_in_the_suite, live_metrics, start_bootstrap, start_node, stop_all
from scripts.bench.relay import Link, Wan

as_in_the_suite()


def links(args: argparse.Namespace, rtt_ms: float) -> list[Link]:
    """The bootstrap's link, then each peer's."""
    n = args.peers

    def link(scale: float) -> Link:
        return Link(
            delay_s=rtt_ms / 2000 * scale,
            jitter_s=args.jitter_ms / 1000,
            stall_p=args.loss,
            stall_s=args.stall_ms / 1000,
            bandwidth_bps=args.bandwidth_mbit * 1e6 / 8,
        )

    return [link(1.0)] + [link(1.0 + args.spread * i / max(1, n - 1)) for i in range(n)]


def run_row(rtt_ms: float, pipeline: str, max_age: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    swarm = f"bench-wan-{pipeline}-{max_age}-{rtt_ms:g}"
    root = tmp / swarm
    root.mkdir()
    node_flags = ["--num-local", str(args.num_local), "--num-external", str(args.num_external)]
    node_flags += ["--net-pipeline", pipeline, "--net-timeout", str(args.net_timeout)]
    node_flags += ["--net-max-age", str(max_age)]
    node_flags += ["--checkpoint-every", "1000"]
    if args.model != "tiny-random":  # a real model learns the CPU recipe's mix, at its own lengths
        node_flags += ["--tasks", "cpu-learn", "--max-new-tokens", "0", "--generations", str(args.generations)]
    with Wan(seed=int(rtt_ms)) as wan:
        boot_link, *peer_links = links(args, rtt_ms)
        host, announce, _ = wan.relayed(boot_link)
        boot, maddrs = start_bootstrap(root, swarm, host=host, announce=announce)
        dirs = [root / f"peer{i}" for i in range(args.peers)]
        nodes: list[Proc] = []
        relays = []
        try:
            for i, d in enumerate(dirs):
                host, announce, relay = wan.relayed(peer_links[i])
                relays.append(relay)
                nodes.append(
                    start_node(
                        d, maddrs, swarm, *node_flags, model=args.model, seed=100 + i, host=host, announce=announce
                    )
                )
            t0 = time.time()
            deadline = time.monotonic() + args.timeout_s
            while not all(len(live_metrics(d)) >= args.rounds for d in dirs):
                dead = [p for p in nodes if not p.alive()]
                if dead:
                    raise RuntimeError(f"{dead[0].out.name} exited:\n{dead[0].text()[-2000:]}")
                if time.monotonic() > deadline:
                    print(f"  {swarm}: --timeout-s passed before every peer finished {args.rounds} rounds")
                    break
                time.sleep(0.5)
            seconds = time.time() - t0
        finally:
            codes = stop_all(nodes)
            boot.stop()
        moved = sum(r.stats.bytes_in + r.stats.bytes_out for r in relays)
    recs = [r for d in dirs for r in live_metrics(d)[args.warmup : args.rounds]]
    row = summarize(rtt_ms, pipeline, recs, moved, codes, seconds, args, peer_links)
    return {**row, "net_max_age": max_age}


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarize(
    rtt_ms: float,
    pipeline: str,
    recs: list[dict[str, Any]],
    moved: int,
    codes: list[int],
    seconds: float,
    args: argparse.Namespace,
    peer_links: list[Link],
) -> dict[str, Any]:
    j = args.num_external
    n = max(1, len(recs))
    ages_r = [a for r in recs for a in r.get("external_age_rounds", [])]
    ages_s = [a for r in recs for a in r.get("external_age_s", [])]
    return {
        "rtt_ms": rtt_ms,
        "pipeline": pipeline,
        "peers": args.peers,
        "links": [str(link) for link in peer_links],
        "rounds": len(recs),
        "round_s_mean": round(statistics.fmean(r["round_s"] for r in recs), 4) if recs else None,
        "round_s_median": _median([r["round_s"] for r in recs]),
        "fetch_wait_s_median": _median([r["phase_s"].get("fetch", 0) + r["phase_s"].get("verify", 0) for r in recs]),
        "publish_wait_s_median": _median([r["phase_s"].get("publish", 0) for r in recs]),
        "prefetch_s_median": _median([r["prefetch_s"] for r in recs if r.get("prefetch_s") is not None]),
        "external_per_round": round(sum(r["num_external"] for r in recs) / n, 3),
        "j": j,
        "share_rounds_full_j": round(sum(1 for r in recs if r["num_external"] >= j) / n, 3),
        "share_rounds_waited": round(sum(1 for r in recs if r.get("prefetch_waited") and r["net_pipeline"]) / n, 3),
        "age_rounds_median": _median(ages_r),
        "age_s_median": _median(ages_s),
        "relay_bytes_per_round": round(moved / n),
        "seconds": round(seconds, 1),
        "exit_codes": codes,
    }


def row_line(row: dict[str, Any]) -> str:
    def f(x: Any, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    return (
        f"RTT {row['rtt_ms']:>5g} ms  pipeline {row['pipeline']:>3} (max age {row['net_max_age']}): "
        f"{row['rounds']:>3} rounds, "
        f"round mean {f(row['round_s_mean'])} s median {f(row['round_s_median'])} s | waited fetch "
        f"{f(row['fetch_wait_s_median'])} s publish {f(row['publish_wait_s_median'])} s | prefetch "
        f"{f(row['prefetch_s_median'])} s | ext/round {row['external_per_round']:.2f} of J={row['j']} "
        f"(all J in {row['share_rounds_full_j']:.0%}) | age {f(row['age_rounds_median'], 1)} rnd "
        f"{f(row['age_s_median'])} s | waited at bound {row['share_rounds_waited']:.0%} | "
        f"{row['relay_bytes_per_round'] / 1e3:.0f} kB/round"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt-ms", default="0,10,50,150", help="comma-separated round trips added by each peer's relay")
    p.add_argument("--pipeline", default="off,on", help="comma-separated --net-pipeline values to compare")
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--model", default="tiny-random", help="the peers' model (another: the cpu-learn mix)")
    p.add_argument(
        "--generations", type=int, default=8, help="G, with a --model other than tiny-random (the node's default)"
    )
    p.add_argument("--rounds", type=int, default=25, help="rounds every peer finishes (rounds past it are ignored)")
    p.add_argument("--warmup", type=int, default=2, help="first rounds of each peer left out (joining)")
    p.add_argument("--num-local", type=int, default=2)
    p.add_argument("--num-external", type=int, default=2)
    p.add_argument("--net-timeout", type=float, default=10.0)
    p.add_argument("--net-max-age", default="0", help="comma-separated --net-max-age values for the pipeline's rows")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=0.0, help="share of chunks held up by a retransmission stall")
    p.add_argument("--stall-ms", type=float, default=200.0)
    p.add_argument("--bandwidth-mbit", type=float, default=0.0, help="per peer and direction (0: no cap)")
    p.add_argument("--spread", type=float, default=0.0, help="peer i's delay is (1 + spread i/(N-1)) x the row's")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per row")
    p.add_argument("--json", type=Path, default=None, help="write the rows here (a JSON list), after each row")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
        ages = [int(a) for a in args.net_max_age.split(",")]
        settings = [(p, a) for p in args.pipeline.split(",") for a in (ages if p != "off" else [0])]
        for rtt in (float(x) for x in args.rtt_ms.split(",")):
            for pipeline, max_age in settings:
                row = run_row(rtt, pipeline, max_age, args, Path(tmp))
                rows.append(row)
                print(row_line(row), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
