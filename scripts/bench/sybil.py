"""Sybil benchmark: do honest peers keep their external groups when many valid keys attack?

    nice -n 10 python -m scripts.bench.sybil --sybils 0,300,1000 --attack ghost,useless,copycat,liars --json OUT

Each row is a fresh swarm on 127.0.0.1: a bootstrap peer, `--honest` honest nodes (the real CLI on the
tiny random model, `sapo-node` subprocesses), and one attacker process (a hivemind DHT client that
holds all Sybil keys and signs for them). The honest nodes run until they have trained on each other;
then the attack runs for `--attack-s` seconds, and `--newcomer-at` of the way in a new honest node
joins (the attack goes on until the others have all trained on it, or `--newcomer-window-s` after its
first round). Attacks, each a new round for every key every `--period` seconds:

* ghost:   presence records announcing a round whose batch is never stored;
* useless: valid batches whose groups carry no learning signal (every completion wrong);
* copycat: every group of the honest peers' newest batches (the newcomer's too), re-signed by each Sybil;
* liars:   `--liars-per-period` keys not used before per period (cycling once all were used), each
           publishing a group with inverted rewards.

The row with 0 Sybils (attack "none") is the yardstick: `honest_external_ratio` of a row is its
`honest_external_per_round` (external groups from honest publishers trained on per honest round, over
the original honest nodes' rounds during the attack) over that of the 0-Sybil row. `newcomer_rounds`
is, over the original honest nodes, the largest number of their rounds from the newcomer's first
published round to the first round that trained on one of its groups (None: never, within the attack).

Keys are minted at `--pow` bits (8 by default, as in the tests), and every node runs with that
difficulty: N keys at the swarm default of 20 bits cost N * 2^20 SHA-256 hashes (about N seconds of one
core of the development machine), 2^12 times what this benchmark pays. Honest nodes mint their default
work tier 1 (4 bits more); Sybils mint `--sybil-tier` (0 by default: the swarm minimum).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from scripts.bench.procs import Proc, as_in_the_suite, live_metrics, prefix_of, start_bootstrap, start_node, stop_all
from scripts.bench.scale import _store_spilled, pct

as_in_the_suite()  # the honest nodes

ATTACKS = ("ghost", "useless", "copycat", "liars")


def honest_args(args: argparse.Namespace) -> list[str]:
    return ["--net-timeout", str(args.net_timeout), "--fetch-max", str(args.fetch_max)]


class Attacker:
    """One DHT client holding every Sybil key; each `step` publishes one attack round. `kind` is one of
    ATTACKS, or several joined by "+" (key i then runs the (i mod n)-th: a mixed attack, as in the tests)."""

    def __init__(
        self,
        kind: str,
        n: int,
        swarm: str,
        maddrs: list[str],
        pow_bits: int,
        tmp: Path,
        victims: list[bytes],
        ttl: float,
        liars_per_period: int,
        tier: int = 0,
    ):
        import hivemind

        from node.learn.tasks import PRESETS, TaskSampler
        from p2p.identity import Identity
        from p2p.pow import tier_difficulty
        from p2p.validators import SapoRecordValidator

        self.kinds, self.swarm, self.tmp, self.ttl = kind.split("+"), swarm, tmp, ttl
        self.victims = victims  # honest keys the copycat copies (the bench tells it; presence would too)
        self.ids = [Identity.generate(tier_difficulty(pow_bits, tier)) for _ in range(n)]  # minted at this tier
        self.kind_of = {ident.public_key_bytes: self.kinds[i % len(self.kinds)] for i, ident in enumerate(self.ids)}
        self.sampler = TaskSampler(PRESETS["smoke"], seed=987_654)
        self.liars_per_period = liars_per_period
        self.next_liar = 0
        self.round = 0
        self.pow_bits = pow_bits
        self.store_timeout_s = 300.0
        self.dht = hivemind.DHT(
            initial_peers=maddrs,
            start=True,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            client_mode=True,
            record_validators=[
                SapoRecordValidator(self.ids[0], swarm, pow_difficulty=pow_bits, also_sign_for=tuple(self.ids[1:]))
            ],
        )

    async def step(self) -> int:
        """One attack round; the number of records stored."""
        from hivemind.utils import get_dht_time

        self.round += 1
        exp = get_dht_time() + self.ttl
        items: list[tuple[str, bytes, bytes, float]] = []
        if self.kinds == ["liars"]:  # a few keys not used before each round
            keys = [self.ids[(self.next_liar + i) % len(self.ids)] for i in range(self.liars_per_period)]
            self.next_liar += len(keys)  # past the last key it starts again (those keys are banned by then)
        else:
            keys = self.ids
        copied = await self._copies() if "copycat" in self.kinds else []
        for ident in keys:
            kind = self.kind_of[ident.public_key_bytes]
            if kind != "ghost":
                groups = copied if kind == "copycat" else self._groups(kind)
                if not groups:
                    continue
                items.append(self._batch_item(ident, groups, exp))
            items += self._presence_items(ident, exp)
        if not items:
            return 0
        fd, path = tempfile.mkstemp(prefix="sapo-sybil-", dir=self.tmp)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(items, f)
        fut = self.dht.run_coroutine(partial(_store_spilled, path=path), return_future=True)
        try:
            return sum(await asyncio.wait_for(fut, self.store_timeout_s))
        except asyncio.TimeoutError:  # the attacker's own DHT is slower than its ambition: go on regardless
            return 0

    def _groups(self, kind: str) -> list[Any]:
        from node.learn.groups import score_responses
        from p2p.wire import TaskSpecWire, WireGroup

        task = self.sampler.sample(1)[0]  # a new task each time: the content is never a repeat
        if kind == "useless":
            completions = ["<answer>certainly not</answer>", "<answer>nope</answer>"]
            return [WireGroup(TaskSpecWire(**task.spec.to_wire()), completions, score_responses(task, completions))]
        completions = [f"<answer>{task.answer}</answer>", "<answer>certainly not</answer>"]
        true = score_responses(task, completions)
        return [WireGroup(TaskSpecWire(**task.spec.to_wire()), completions, [1.0 - x for x in true])]

    async def _copies(self) -> list[Any]:
        """Every group of each victim's newest batch (read like any peer: presence, then the batch key)."""
        from p2p.dht_process import get_many_in_dht
        from p2p.validators import DEFAULT_PRESENCE_SHARDS, batch_key, owner_of_subkey, presence_key, presence_shard
        from p2p.wire import decode_presence, decode_signed

        async def get(keys: list[str]) -> dict[str, dict[bytes, bytes]]:
            fut = self.dht.run_coroutine(partial(get_many_in_dht, keys=keys), return_future=True)
            try:
                found = await asyncio.wait_for(fut, 10)
            except Exception:
                return {}
            return {k: {owner_of_subkey(s): v for s, v in e.items()} for k, e in found.items()}

        shards = await get([presence_key(self.swarm, presence_shard(v, DEFAULT_PRESENCE_SHARDS)) for v in self.victims])
        rounds = {}
        for entries in shards.values():
            for pub, data in entries.items():
                if pub in self.victims:
                    try:
                        rounds[pub] = decode_presence(data, pow_difficulty=self.pow_bits).round
                    except Exception:
                        pass
        batches = await get([batch_key(self.swarm, pub, r) for pub, r in rounds.items()])
        groups = []
        for entries in batches.values():
            for data in entries.values():
                try:
                    groups += decode_signed(data, pow_difficulty=self.pow_bits).groups
                except Exception:
                    pass
        return groups[:64]

    def _batch_item(self, ident: Any, groups: list[Any], exp: float) -> tuple[str, bytes, bytes, float]:
        from p2p.validators import batch_key, owner_subkey
        from p2p.wire import WIRE_VERSION, RolloutBatch, encode_signed

        pub = ident.public_key_bytes
        data = encode_signed(
            RolloutBatch(WIRE_VERSION, self.swarm, self.round, pub, time.time(), "sybil", groups), ident
        )
        return batch_key(self.swarm, pub, self.round), owner_subkey(pub), data, exp

    def _presence_items(self, ident: Any, exp: float) -> list[tuple[str, bytes, bytes, float]]:
        from p2p.validators import DEFAULT_PRESENCE_SHARDS, owner_subkey, presence_keys_for
        from p2p.wire import WIRE_VERSION, PresenceRecord, encode_presence

        pub = ident.public_key_bytes
        data = encode_presence(PresenceRecord(WIRE_VERSION, self.swarm, pub, self.round, time.time()), ident)
        homes = presence_keys_for(self.swarm, pub, ident.pow_nonce, self.pow_bits, DEFAULT_PRESENCE_SHARDS)
        return [(home, owner_subkey(pub), data, exp) for home in homes]

    def shutdown(self) -> None:
        self.dht.shutdown()


def wait_until(pred, procs: list[Proc], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        dead = [p for p in procs if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].out.name} exited while waiting for {what}:\n{dead[0].text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(1.0)


def run_row(n: int, attack: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    swarm = f"bench-sybil-{attack}-{n}"
    root = tmp / swarm
    root.mkdir()
    boot, maddrs = start_bootstrap(root, swarm)
    dirs = [root / f"honest{i}" for i in range(args.honest)]
    nodes = [start_node(d, maddrs, swarm, *honest_args(args), seed=100 + i) for i, d in enumerate(dirs)]
    newcomer_dir = root / "newcomer"
    newcomer = None
    attacker = None
    procs = [boot, *nodes]
    try:
        keys = [prefix_of(d) for d in dirs]
        wait_until(
            lambda: all(
                len({s for r in live_metrics(d) for s in r.get("external_sources", {})} & set(keys)) >= len(keys) - 1
                for d in dirs
            ),
            procs,
            args.warmup_s,
            "the honest nodes to train on each other",
        )
        from p2p.identity import KEY_FILENAME, Identity

        victims = [Identity.load_or_create(d / KEY_FILENAME, create=False).public_key_bytes for d in dirs]
        if n:
            attacker = Attacker(
                attack, n, swarm, maddrs, args.pow, root, victims, args.ttl, args.liars_per_period, args.sybil_tier
            )
        t_attack = time.time()
        stored = 0
        loop = asyncio.new_event_loop()

        def newcomer_judged() -> bool:
            """Past the newcomer's window, or trained on by every original honest node already."""
            recs = live_metrics(newcomer_dir) if newcomer is not None else []
            if not recs:
                return False
            if time.time() - recs[0]["t_end"] >= args.newcomer_window_s:
                return True
            key = prefix_of(newcomer_dir)
            return all(any(key in r.get("external_sources", {}) for r in live_metrics(d)) for d in dirs)

        try:
            while time.time() - t_attack < args.attack_s or not newcomer_judged():
                t0 = time.time()
                if newcomer is None and t0 - t_attack >= args.newcomer_at * args.attack_s:
                    newcomer = start_node(newcomer_dir, maddrs, swarm, *honest_args(args), seed=199)
                    procs.append(newcomer)
                    if attacker is not None:
                        attacker.victims.append(bytes.fromhex(_full_key(newcomer_dir)))
                if attacker is not None:
                    stored += loop.run_until_complete(attacker.step())
                for p in procs:
                    if not p.alive():
                        raise RuntimeError(f"{p.out.name} exited during the attack:\n{p.text()[-2000:]}")
                time.sleep(max(0.0, args.period - (time.time() - t0)))
        finally:
            loop.close()
        t_end = time.time()
    finally:
        if attacker is not None:
            attacker.shutdown()
        codes = stop_all([*nodes, *([newcomer] if newcomer else [])])
        boot.stop()
    return summarize(n, attack, dirs, newcomer_dir, keys, t_attack, t_end, stored, codes, args)


def _full_key(run_dir: Path) -> str:
    from p2p.identity import KEY_FILENAME, Identity

    prefix_of(run_dir)  # waits for the identity file
    return Identity.load_or_create(run_dir / KEY_FILENAME, create=False).public_key_hex


def summarize(
    n: int,
    attack: str,
    dirs: list[Path],
    newcomer_dir: Path,
    keys: list[str],
    t_attack: float,
    t_end: float,
    stored: int,
    codes: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    newcomer_key = prefix_of(newcomer_dir) if (newcomer_dir / "identity.ed25519").exists() else None
    honest = set(keys) | ({newcomer_key} if newcomer_key else set())
    rounds = {d: [r for r in live_metrics(d) if t_attack <= r["t_start"] <= t_end] for d in dirs}
    all_rounds = [r for rs in rounds.values() for r in rs]
    ext_honest = [sum(v for k, v in r.get("external_sources", {}).items() if k in honest) for r in all_rounds]
    ext_sybil = [sum(v for k, v in r.get("external_sources", {}).items() if k not in honest) for r in all_rounds]
    newcomer_rounds = None
    newcomer_recs = live_metrics(newcomer_dir) if newcomer_key else []
    if newcomer_recs:
        t_first = newcomer_recs[0]["t_end"]  # its first batch is published during its first round
        worst = 0
        for d in dirs:
            later = [r for r in live_metrics(d) if r["t_start"] >= t_first]
            hit = next((i + 1 for i, r in enumerate(later) if newcomer_key in r.get("external_sources", {})), None)
            if hit is None:
                worst = None
                break
            worst = max(worst, hit)
        newcomer_rounds = worst
    bans = 0
    for d in [*dirs, newcomer_dir]:
        path = d / "reputation.json"
        if path.exists():
            peers = json.loads(path.read_text()).get("peers", {})
            bans += sum(1 for s in peers.values() if s.get("banned_until", 0) > t_end)
    io = [r["swarm_io_s"] for r in all_rounds]
    reasons: dict[str, int] = {}
    for r in all_rounds:
        for k, v in r.get("rejected_by_reason", {}).items():
            reasons[k] = reasons.get(k, 0) + v
    return {
        "sybils": n,
        "attack": attack if n else "none",
        "honest_rounds": len(all_rounds),
        "honest_external_per_round": round(statistics.mean(ext_honest), 3) if ext_honest else 0.0,
        "sybil_external_per_round": round(statistics.mean(ext_sybil), 3) if ext_sybil else 0.0,
        "newcomer_rounds": newcomer_rounds,
        "round_s_p99": round(pct([r["round_s"] for r in all_rounds], 99), 2) if all_rounds else None,
        "swarm_io_s_p99": round(pct(io, 99), 2) if io else None,
        "swarm_io_s_max": round(max(io), 2) if io else None,
        "net_timeout": args.net_timeout,
        "bans": bans,
        "rejected_by_reason": reasons,
        "attack_records_stored": stored,
        "attack_s": round(t_end - t_attack, 1),
        "exit_codes": codes,
        "pow_bits": args.pow,
        "sybil_tier": args.sybil_tier,
        "newcomer_at": args.newcomer_at,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sybils", default="0,300,1000", help="comma-separated numbers of Sybil keys (0: no attack)")
    p.add_argument("--attack", default=",".join(ATTACKS), help=f"comma-separated, of {ATTACKS}")
    p.add_argument("--json", type=Path, default=None, help="write the rows here (a JSON list), after each row")
    p.add_argument("--honest", type=int, default=3)
    p.add_argument("--attack-s", type=float, default=150.0)
    p.add_argument("--newcomer-at", type=float, default=0.5, help="fraction of the attack after which it joins")
    p.add_argument(
        "--newcomer-window-s",
        type=float,
        default=60.0,
        help="the attack goes on at least this long after the newcomer's first round",
    )
    p.add_argument("--warmup-s", type=float, default=300.0)
    p.add_argument("--period", type=float, default=4.0, help="seconds between attack rounds")
    p.add_argument("--liars-per-period", type=int, default=20)
    p.add_argument("--ttl", type=float, default=120.0, help="expiration of the attacker's records")
    p.add_argument("--net-timeout", type=float, default=4.0)
    p.add_argument("--fetch-max", type=int, default=16)
    p.add_argument(
        "--sybil-tier",
        type=int,
        default=0,
        help="work tier the Sybil keys are minted at (4 bits above --pow each; honest nodes mint tier 1)",
    )
    p.add_argument("--pow", type=int, default=int(os.environ.get("SAPO_POW_DIFFICULTY", "8")))
    args = p.parse_args(argv)
    os.environ["SAPO_POW_DIFFICULTY"] = str(args.pow)  # the nodes and the bootstrap mint and check at this D
    import logging

    logging.getLogger("hivemind").setLevel(logging.ERROR)
    rows: list[dict[str, Any]] = []
    plan = [(int(n), a) for n in args.sybils.split(",") for a in (args.attack.split(",") if int(n) else ["none"])]
    with tempfile.TemporaryDirectory(prefix="sapo-bench-sybil-") as tmp:
        for n, attack in plan:
            print(f"sybils={n} attack={attack}", flush=True)
            row = run_row(n, attack, args, Path(tmp))
            rows.append(row)
            base = next((r["honest_external_per_round"] for r in rows if r["sybils"] == 0), None)
            for r in rows:
                r["honest_external_ratio"] = round(r["honest_external_per_round"] / base, 3) if base else None
            print(json.dumps(row), flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
