#!/usr/bin/env python
"""Churn soak (what home machines and the internet do to a community node): a swarm of real node processes
where peers are SIGKILLed and resumed, some join late, some sit behind a poor emulated home link, and the
bootstrap restarts; against the same swarm calm.

    python -m scripts.bench.churn --peers 20 --minutes 20 --out docs/data/churn
    python -m scripts.bench.churn --peers 6 --minutes 3 --together --out /tmp/churn-dry   # a dry run

Two swarms, "calm" and "churn", each with its own bootstrap (`python -m bootstrap.main`) and --peers node
processes (`python -m node.cli`, tiny random model, smoke tasks, a checkpoint every round). By default they
run one after the other for --minutes each (20 tiny-model peers take ~13 GB here; 40 do not fit in 24 GB);
--together runs them side by side so that both share the machine's load. In both, --netns-peers peers sit
each in a network namespace made here (veth pair, 10.214.k.0/24, random loss with iptables' `statistic`
match both ways, tbf rate limits: this kernel has no sch_netem, so there is no added delay); everything
else listens on a hub address (10.214.0.1, a veth pair kept in the root namespace). Without root, all
peers use 127.0.0.1 and the report says so. Only the churn swarm gets: a random peer SIGKILLed every
--kill-every seconds (the node process only, as the OOM killer would; what of it survives 5 s later is
counted and killed) and restarted with --resume after --pause seconds; --late peers starting at --late-at;
the bootstrap SIGKILLed at half time and restarted --boot-down seconds later at the same address and key.

Report (--out: results.json and report.md): rounds per peer (calm vs churn), the longest network wait of
any round (publish, fetch, verify from metrics.jsonl), checkpoints that failed to load after a kill, rounds
lost or repeated (metrics.jsonl contiguous, lines moved to metrics.orphaned.jsonl) and duplicate groups the
verifiers counted, RSS growth per hour per long-lived peer (VmRSS every --sample-s, slope over the second
half), and peers that exited on their own (code and last log lines). Run it from the repository root with
the repository on PYTHONPATH; namespaces need root. Ctrl-C stops every process and removes the namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_FLAGS = [
    "--model",
    "tiny-random",
    "--tasks",
    "smoke",
    "--rollout-engine",
    "torch",
    "--lora-rank",
    "0",
    "--generations",
    "4",
    "--num-local",
    "2",
    "--num-external",
    "2",
    "--threads",
    "1",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "1",
    "--rounds",
    "1000000",
    "--identity-tier",
    "0",
]
CKPT_FAIL = ("skipping checkpoint", "no loadable checkpoint", "CheckpointError")
DUP_REASONS = ("duplicate", "repeated", "equivocation", "copied_from")


def sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(full, capture_output=True, text=True, check=check)


class Net:
    """The namespaces, veth pairs, loss rules and rate limits this script makes, and their removal."""

    def __init__(self, count: int, loss: float, up: str, down: str) -> None:
        self.tag = f"{os.getpid() % 100000:05d}"
        self.hub = "127.0.0.1"
        self.namespaces: list[tuple[str, str]] = []  # (name, address) of each peer namespace
        self.links: list[str] = []
        self.forward: str | None = None
        self.note = ""
        if count == 0:
            self.note = "no namespaces asked for: every peer on 127.0.0.1"
            return
        if os.geteuid() != 0:
            self.note = "not root: no namespaces, every peer on 127.0.0.1 (no loss, no rate limit)"
            return
        if "10.214." in sh("ip", "-4", "addr").stdout:
            raise SystemExit("bench.churn: 10.214.0.0/16 is in use on this machine (another run?); not touching it")
        try:
            self._make(count, loss, up, down)
        except (subprocess.CalledProcessError, OSError) as exc:
            self.close()
            err = getattr(exc, "stderr", "") or exc
            raise SystemExit(f"bench.churn: making the namespaces failed: {err}") from None

    def _make(self, count: int, loss: float, up: str, down: str) -> None:
        hub_a, hub_b = f"sk{self.tag}ha", f"sk{self.tag}hb"
        sh("ip", "link", "add", hub_a, "type", "veth", "peer", "name", hub_b)
        self.links.append(hub_a)
        sh("ip", "addr", "add", "10.214.0.1/32", "dev", hub_a)
        for dev in (hub_a, hub_b):
            sh("ip", "link", "set", dev, "up")
        self.hub = "10.214.0.1"
        self.forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # namespace to namespace through the root one
        for k in range(1, count + 1):
            ns, host, inner = f"sapo-soak-{self.tag}-{k}", f"sk{self.tag}{k:02d}h", f"sk{self.tag}{k:02d}n"
            sh("ip", "netns", "add", ns)
            self.namespaces.append((ns, f"10.214.{k}.2"))
            sh("ip", "link", "add", host, "type", "veth", "peer", "name", inner, "netns", ns)
            sh("ip", "addr", "add", f"10.214.{k}.1/24", "dev", host)
            sh("ip", "link", "set", host, "up")
            sh("ip", "addr", "add", f"10.214.{k}.2/24", "dev", inner, ns=ns)
            for dev in ("lo", inner):
                sh("ip", "link", "set", dev, "up", ns=ns)
            sh("ip", "route", "add", "default", "via", f"10.214.{k}.1", ns=ns)
            for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
                sh(
                    "iptables",
                    "-A",
                    chain,
                    flag,
                    inner,
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    str(loss),
                    "-j",
                    "DROP",
                    ns=ns,
                )
            sh(
                "tc",
                "qdisc",
                "add",
                "dev",
                inner,
                "root",
                "tbf",
                "rate",
                up,
                "burst",
                "32kbit",
                "latency",
                "400ms",
                ns=ns,
            )
            sh("tc", "qdisc", "add", "dev", host, "root", "tbf", "rate", down, "burst", "64kbit", "latency", "400ms")
        self.note = (
            f"{count} namespace(s): veth pairs in 10.214.k.0/24, {loss:.0%} random loss each way (iptables "
            f"statistic), tbf {up} up / {down} down, no added delay (no sch_netem in this kernel)"
        )

    def close(self) -> None:
        for ns, _ in self.namespaces:
            sh("ip", "netns", "del", ns, check=False)  # its veth end goes with it, and the pair with that
        for link in self.links:
            sh("ip", "link", "del", link, check=False)
        if self.forward is not None:
            Path("/proc/sys/net/ipv4/ip_forward").write_text(self.forward)
        self.namespaces, self.links, self.forward = [], [], None


def session_pids(sid: int) -> list[int]:
    """Processes of a session (a peer started with setsid: the node, its DHT process, p2pd, ...)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                out.append(int(entry))
    return out


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def last_round(path: Path) -> int:
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["round"])
        except (ValueError, KeyError, TypeError):
            continue
    return -1


def kill_session(sid: int) -> list[str]:
    """SIGKILL every process of a session; returns their names."""
    names = []
    for pid in session_pids(sid):
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return names


@dataclass
class Peer:
    name: str
    run_dir: Path
    seed: int
    ns: str | None = None
    addr: str = "127.0.0.1"
    late: bool = False
    proc: subprocess.Popen | None = None
    state: str = "new"  # running, killed (by us), stopped (by us), exited (on its own)
    started: float = 0.0
    up_s: float = 0.0
    starts: int = 0
    events: list[dict] = field(default_factory=list)  # kills, restarts, exits
    rss: list[list[float]] = field(default_factory=list)  # [t, node MB, session MB, incarnation]
    cpu_done: float = 0.0  # CPU seconds of the finished incarnations (node, DHT process, p2pd)
    cpu_now: float = 0.0  # of the running one, at its last sample

    def sample_cpu(self) -> None:
        self.cpu_now = max(self.cpu_now, cpu_s(session_pids(self.proc.pid)))

    def down(self, state: str) -> None:
        self.state = state
        self.up_s += time.time() - self.started
        self.cpu_done, self.cpu_now = self.cpu_done + self.cpu_now, 0.0


class Swarm:
    """One bootstrap and its peers; `churn` decides whether anything bad is done to them."""

    def __init__(self, name: str, args: argparse.Namespace, work: Path, hub: str, namespaces: list) -> None:
        self.name, self.args, self.dir, self.hub = name, args, work / name, hub
        self.dir.mkdir(parents=True)
        self.port = free_port(hub)
        self.boot: subprocess.Popen | None = None
        self.boot_events: list[dict] = []
        self.maddr, self.t0 = "", time.time()
        self.machine: list[list[float]] = []  # [t, MemAvailable GB, load average 1 min] while this swarm ran
        self.cut_short = ""
        self.peers = [Peer(f"{name}{i:02d}", self.dir / f"peer{i:02d}", seed=i, addr=hub) for i in range(args.peers)]
        for peer, (ns, addr) in zip(self.peers, namespaces):
            peer.ns, peer.addr = ns, addr
        if name == "churn" and args.late:
            for peer in self.peers[-args.late :]:
                peer.late = True

    def now(self) -> float:
        return round(time.time() - self.t0, 1)

    def start_bootstrap(self) -> None:
        bdir = self.dir / "bootstrap"
        bdir.mkdir(exist_ok=True)
        (bdir / "maddrs.txt").unlink(missing_ok=True)
        cmd = [
            "nice",
            "-n",
            "10",
            sys.executable,
            "-m",
            "bootstrap.main",
            "--identity-dir",
            str(bdir),
            "--swarm",
            self.name,
            "--host-maddrs",
            f"/ip4/{self.hub}/tcp/{self.port}",
            "--maddrs-file",
            str(bdir / "maddrs.txt"),
            "--pow-difficulty",
            str(self.args.pow),
        ]
        with open(bdir / "bootstrap.log", "ab") as log:
            self.boot = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.time() + 120
        while not (bdir / "maddrs.txt").exists() or not (bdir / "maddrs.txt").read_text().strip():
            if self.boot.poll() is not None or time.time() > deadline:
                raise SystemExit(f"bench.churn: the {self.name} bootstrap did not start; see {bdir}/bootstrap.log")
            time.sleep(0.3)
        maddr = (bdir / "maddrs.txt").read_text().split()[0]
        self.boot_events.append({"t": self.now(), "event": "up", "same_address": maddr == (self.maddr or maddr)})
        self.maddr = self.maddr or maddr

    def start(self, peer: Peer, resume: bool) -> None:
        peer.run_dir.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "node.cli",
            *NODE_FLAGS,
            "--run-dir",
            str(peer.run_dir),
            "--peers",
            self.maddr,
            "--swarm",
            self.name,
            "--seed",
            str(peer.seed),
            "--name",
            peer.name,
            "--pow-difficulty",
            str(self.args.pow),
            "--host-maddrs",
            f"/ip4/{peer.addr}/tcp/0",
            *self.args.node_arg,
        ]
        cmd += ["--resume"] if resume else []
        prefix = (["ip", "netns", "exec", peer.ns] if peer.ns else []) + ["nice", "-n", "10"]
        node_log = peer.run_dir / "node.log"
        offset = node_log.stat().st_size if node_log.exists() else 0
        with open(peer.run_dir / "console.log", "ab") as log:
            peer.proc = subprocess.Popen(
                prefix + cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        peer.state, peer.started = "running", time.time()
        peer.starts += 1
        peer.events.append({"t": self.now(), "event": "restart" if resume else "start", "log_offset": offset})

    def running(self) -> list[Peer]:
        return [p for p in self.peers if p.state == "running"]

    def trained(self) -> list[Peer]:
        """Running peers that have finished a round since their last start (a kill tests their checkpoint)."""
        out = []
        for peer in self.running():
            offset = next(e["log_offset"] for e in reversed(peer.events) if e["event"] in ("start", "restart"))
            with open(peer.run_dir / "node.log", "rb") as f:
                f.seek(offset)
                if b" | reward " in f.read():
                    out.append(peer)
        return out

    def kill(self, peer: Peer) -> None:
        """SIGKILL the node process alone (as the OOM killer would); what of its session outlives it 5 s later
        is counted and killed."""
        before = last_round(peer.run_dir / "metrics.jsonl")
        peer.sample_cpu()
        peer.proc.kill()
        peer.proc.wait()
        peer.down("killed")
        time.sleep(5)
        peer.events.append(
            {"t": self.now(), "event": "kill", "last_round": before, "survivors": kill_session(peer.proc.pid)}
        )

    def kill_bootstrap(self) -> None:
        self.boot.kill()
        self.boot.wait()
        time.sleep(2)
        self.boot_events.append({"t": self.now(), "event": "SIGKILL", "survivors": kill_session(self.boot.pid)})

    def sample(self) -> None:
        for peer in self.running():
            sess = session_pids(peer.proc.pid)
            peer.sample_cpu()
            peer.rss.append(
                [self.now(), round(rss_mb(peer.proc.pid), 1), round(sum(rss_mb(p) for p in sess), 1), peer.starts]
            )

    def reap(self) -> None:
        """Peers that exited without our signal: a crash, or a node that gave up."""
        for peer in self.running():
            if peer.proc.poll() is not None:
                peer.down("exited")
                log = peer.run_dir / "node.log"
                tail = log.read_text(errors="replace").splitlines()[-8:] if log.exists() else []
                peer.events.append(
                    {
                        "t": self.now(),
                        "event": "exited",
                        "code": peer.proc.returncode,
                        "log": tail,
                        "survivors": kill_session(peer.proc.pid),
                    }
                )

    def stop_all(self) -> None:
        """SIGTERM each peer (it checkpoints and exits), then the bootstrap; SIGKILL what is left after 120 s."""
        self.reap()
        live = self.running()
        for peer in live:
            peer.sample_cpu()
            peer.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 120
        for peer in live:
            try:
                peer.proc.wait(max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                peer.proc.kill()
                peer.proc.wait()
            peer.down("stopped")
            peer.events.append(
                {
                    "t": self.now(),
                    "event": "stopped",
                    "code": peer.proc.returncode,
                    "survivors": kill_session(peer.proc.pid),
                }
            )
        if self.boot is not None and self.boot.poll() is None:
            self.boot.send_signal(signal.SIGTERM)
            try:
                self.boot.wait(30)
            except subprocess.TimeoutExpired:
                self.boot.kill()
        self.kill_everything()

    def kill_everything(self) -> None:
        for proc in [p.proc for p in self.peers if p.proc is not None] + ([self.boot] if self.boot else []):
            kill_session(proc.pid)


# ------------------------------------------------------------------------------------------- the run


def machine_now() -> tuple[float, float]:
    """MemAvailable in GB and the 1-minute load average."""
    avail = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) / 2**20
    return round(avail, 2), float(Path("/proc/loadavg").read_text().split()[0])


def run(swarms: list[Swarm], args: argparse.Namespace) -> None:
    """Start the swarms, do the churn swarm's harm on schedule, sample RSS, stop everyone at the end."""
    rng = random.Random(args.seed)
    duration = args.minutes * 60
    for s in swarms:
        s.t0 = time.time()
        s.start_bootstrap()
    for i in range(args.peers):  # interleaved, so that neither swarm gets a head start
        for s in swarms:
            if not s.peers[i].late:
                s.start(s.peers[i], resume=False)
        time.sleep(args.stagger)
    t0 = min(s.t0 for s in swarms)
    churn = next((s for s in swarms if s.name == "churn"), None)
    late_at = min(args.late_at, duration / 4)
    next_kill = t0 + 60 + rng.uniform(*args.kill_every)
    boot_kill_at, boot_up_at = t0 + duration / 2, None
    restarts: list[tuple[float, Peer]] = []
    next_sample = time.time()
    while time.time() < t0 + duration:
        now = time.time()
        for s in swarms:
            s.reap()
        if now >= next_sample:
            avail, load = machine_now()
            for s in swarms:
                s.sample()
                s.machine.append([s.now(), avail, load])
            next_sample = now + args.sample_s
            if avail < args.min_free_gb:  # this machine is shared: stop before the OOM killer picks anyone
                for s in swarms:
                    s.cut_short = f"stopped at {s.now()} s: MemAvailable {avail} GB < --min-free-gb"
                print(f"bench.churn: {swarms[0].cut_short}", flush=True)
                break
        if churn is not None:
            if now >= t0 + late_at:
                for peer in churn.peers:
                    if peer.late and peer.state == "new":
                        churn.start(peer, resume=False)
            if boot_kill_at is not None and now >= boot_kill_at:
                churn.kill_bootstrap()
                boot_kill_at, boot_up_at = None, now + args.boot_down
            if boot_up_at is not None and now >= boot_up_at:
                churn.start_bootstrap()
                boot_up_at = None
            if now >= next_kill:
                victims = churn.trained()
                if victims:
                    victim = rng.choice(victims)
                    churn.kill(victim)
                    restarts.append((time.time() + rng.uniform(*args.pause), victim))
                next_kill = time.time() + rng.uniform(*args.kill_every)
            for due, peer in [r for r in restarts if r[0] <= time.time()]:
                restarts.remove((due, peer))
                churn.start(peer, resume=True)
        time.sleep(1)
    for s in swarms:
        s.stop_all()


# ------------------------------------------------------------------------------------------ the report


def records(path: Path) -> list[dict]:
    out = []
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"round": None})  # a cut line: counted as a break in the rounds
    return out


def slope_mb_per_h(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 4:
        return None
    n = len(points)
    mt, mv = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return round(sum((t - mt) * (v - mv) for t, v in points) / var, 1) if var else None  # t in hours


def resumes(peer: Peer) -> list[dict]:
    """Each restart after a kill: the checkpoint it resumed from, rounds lost, and any checkpoint that failed."""
    text = (peer.run_dir / "node.log").read_bytes() if (peer.run_dir / "node.log").exists() else b""
    out, last_kill = [], None
    for ev in peer.events:
        if ev["event"] == "kill":
            last_kill = ev
        if ev["event"] != "restart":
            continue
        part = text[ev["log_offset"] :].decode(errors="replace").split("sapo.cli: loading model", 2)
        part = part[1] if len(part) > 1 else part[0]  # this start's lines (up to the next start)
        item = {
            "t": ev["t"],
            "last_round_before_kill": last_kill["last_round"] if last_kill else None,
            "checkpoint_failures": sum(part.count(m) for m in CKPT_FAIL),
        }
        item["stopped_in_startup"] = "stopped during start-up" in part  # our end-of-run SIGTERM came first
        for line in part.splitlines():
            if "resumed from round-" in line:
                item["resumed_from"] = int(line.split("resumed from round-")[1].split(":")[0])
                item["next_round"] = int(line.split("next round ")[1].split()[0])
                break
            if "--resume: no checkpoint" in line:
                item["resumed_from"], item["next_round"] = None, 0
                break
        if "next_round" in item and (item["last_round_before_kill"] if last_kill else -1) >= 0:
            item["rounds_redone"] = item["last_round_before_kill"] - (item["next_round"] - 1)
        out.append(item)
    return out


def peer_report(peer: Peer, s: Swarm, duration: float) -> dict:
    recs = records(peer.run_dir / "metrics.jsonl")
    rounds = [r.get("round") for r in recs]
    orphaned = records(peer.run_dir / "metrics.orphaned.jsonl")
    trained = [g for r in recs for g in r.get("external_groups", [])]
    waits = [
        (
            max(r["phase_s"].get("publish", 0), r["phase_s"].get("fetch", 0), r.get("verify_s", 0)),
            r["phase_s"].get("publish", 0),
            r["phase_s"].get("fetch", 0),
            r.get("verify_s", 0),
            r["round"],
        )
        for r in recs
        if "phase_s" in r
    ]
    dups = {k: sum(r.get("rejected_by_reason", {}).get(k, 0) for r in recs) for k in DUP_REASONS}
    joined = [r["t_start"] - s.t0 for r in recs if r.get("swarm_state") == "joined" and "t_start" in r]
    half = [(t / 3600, v) for t, v, _, inc in peer.rss if t >= duration / 2 and inc == peer.starts]
    half_sess = [(t / 3600, v) for t, _, v, inc in peer.rss if t >= duration / 2 and inc == peer.starts]
    console = (
        (peer.run_dir / "console.log").read_text(errors="replace") if (peer.run_dir / "console.log").exists() else ""
    )
    return {
        "peer": peer.name,
        "netns": peer.ns is not None,
        "late": peer.late,
        "starts": peer.starts,
        "up_min": round(peer.up_s / 60, 2),
        "rounds": len(recs),
        "rounds_per_up_min": round(len(recs) / (peer.up_s / 60), 2) if peer.up_s else None,
        "cpu_min": round(peer.cpu_done / 60, 2),
        "rounds_per_cpu_min": round(len(recs) / (peer.cpu_done / 60), 2) if peer.cpu_done else None,
        "rounds_contiguous": rounds == list(range(len(recs))),
        "duplicate_rounds": len(rounds) - len(set(rounds)),
        "external_groups": len(trained),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "orphaned_lines": len(orphaned),
        "rounds_solo": sum(1 for r in recs if r.get("swarm_state") == "solo"),
        "external_per_round": round(sum(r.get("num_external", 0) for r in recs) / max(len(recs), 1), 2),
        "first_joined_s": round(min(joined), 1) if joined else None,
        "max_wait": dict(zip(("s", "publish", "fetch", "verify", "round"), max(waits))) if waits else None,
        "max_round_s": max((r.get("round_s", 0) for r in recs), default=None),
        "dup_rejections": dups,
        "resumes": resumes(peer),
        "crashes": [e for e in peer.events if e["event"] == "exited" or (e["event"] == "stopped" and e["code"])],
        "survivors_after_kill": [e["survivors"] for e in peer.events if e["event"] == "kill" and e["survivors"]],
        "console_tracebacks": console.count("Traceback (most recent call last)"),
        # only an incarnation that lived through the whole second half has a slope
        "rss_node_mb_per_h": slope_mb_per_h(half) if peer.starts == 1 and not peer.late else None,
        "rss_session_mb_per_h": slope_mb_per_h(half_sess) if peer.starts == 1 and not peer.late else None,
        "rss_node_mb_last": peer.rss[-1][1] if peer.rss else None,
        "rss_session_mb_last": peer.rss[-1][2] if peer.rss else None,
        "rss": peer.rss,
    }


def swarm_report(s: Swarm, duration: float) -> dict:
    peers = [peer_report(p, s, duration) for p in s.peers]
    rounds = [p["rounds"] for p in peers]
    waits = [p["max_wait"] for p in peers if p["max_wait"]]
    longest = max(waits, key=lambda w: w["s"], default=None)
    res = [r for p in peers for r in p["resumes"]]
    slopes = [p["rss_node_mb_per_h"] for p in peers if p["rss_node_mb_per_h"] is not None]
    slopes_s = [p["rss_session_mb_per_h"] for p in peers if p["rss_session_mb_per_h"] is not None]
    return {
        "peers": len(peers),
        "rounds_mean": round(sum(rounds) / len(rounds), 1),
        "rounds_min": min(rounds),
        "rounds_max": max(rounds),
        "rounds_mean_on_time": round(
            sum(p["rounds"] for p in peers if not p["late"]) / max(1, sum(1 for p in peers if not p["late"])), 1
        ),
        "rounds_per_up_min_mean": round(sum(p["rounds_per_up_min"] or 0 for p in peers) / len(peers), 2),
        "rounds_per_cpu_min": round(sum(rounds) / max(sum(p["cpu_min"] for p in peers), 1e-9), 2),
        "longest_wait": longest and {**longest, "peer": next(p["peer"] for p in peers if p["max_wait"] is longest)},
        "max_round_s": max((p["max_round_s"] or 0 for p in peers), default=None),
        "kills": sum(1 for p in s.peers for e in p.events if e["event"] == "kill"),
        "restarts": len(res),
        "checkpoint_failures": sum(r["checkpoint_failures"] for r in res),
        "restarts_without_resume_line": sum(1 for r in res if "next_round" not in r and not r["stopped_in_startup"]),
        "restarts_stopped_in_startup": sum(1 for r in res if r["stopped_in_startup"]),
        "rounds_redone": sum(r.get("rounds_redone", 0) for r in res),
        "rounds_not_contiguous": sum(1 for p in peers if not p["rounds_contiguous"]),
        "duplicate_rounds": sum(p["duplicate_rounds"] for p in peers),
        "groups_trained_twice": sum(p["groups_trained_twice"] for p in peers),
        "external_groups_trained": sum(p["external_groups"] for p in peers),
        "dup_rejections": {k: sum(p["dup_rejections"][k] for p in peers) for k in DUP_REASONS},
        "rounds_solo": sum(p["rounds_solo"] for p in peers),
        "crashes": sum(len(p["crashes"]) for p in peers),
        "kills_with_survivors": sum(len(p["survivors_after_kill"]) for p in peers),
        "console_tracebacks": sum(p["console_tracebacks"] for p in peers),
        "rss_node_mb_per_h": {"mean": round(sum(slopes) / len(slopes), 1), "max": max(slopes), "peers": len(slopes)}
        if slopes
        else None,
        "rss_session_mb_per_h": {
            "mean": round(sum(slopes_s) / len(slopes_s), 1),
            "max": max(slopes_s),
            "peers": len(slopes_s),
        }
        if slopes_s
        else None,
        "bootstrap": s.boot_events,
        "cut_short": s.cut_short,
        "mem_available_min_gb": min((m[1] for m in s.machine), default=None),
        "load_avg_mean": round(sum(m[2] for m in s.machine) / len(s.machine), 2) if s.machine else None,
        "machine": s.machine,
        "per_peer": peers,
    }


def markdown(result: dict) -> str:
    sw = result["swarms"]
    names = [n for n in ("calm", "churn") if n in sw]

    def row(label: str, fn) -> str:
        return f"| {label} | " + " | ".join(str(fn(sw[n])) for n in names) + " |"

    def wait(w: dict | None) -> str:
        return (
            "–"
            if not w
            else (
                f"{w['s']:.2f} s ({w['peer']} round {w['round']}: publish {w['publish']:.2f}, "
                f"fetch {w['fetch']:.2f}, verify {w['verify']:.2f})"
            )
        )

    def rss(r: dict | None) -> str:
        return "–" if not r else f"{r['mean']:+.1f} (max {r['max']:+.1f}, {r['peers']} peers)"

    lines = [
        f"Command: `{result['command']}`",
        "",
        f"{result['started']}, {result['minutes']} min per swarm, {result['peers']} peers each, "
        f"{'side by side' if result['together'] else 'one after the other (calm first)'}; "
        f"network: {result['net']}.",
        "",
        "| figure | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        row("rounds per peer: mean (min–max)", lambda s: f"{s['rounds_mean']} ({s['rounds_min']}–{s['rounds_max']})"),
        row("rounds per peer started on time: mean", lambda s: s["rounds_mean_on_time"]),
        row(
            "machine: load average (mean) / MemAvailable (min)",
            lambda s: f"{s['load_avg_mean']} / {s['mem_available_min_gb']} GB",
        ),
        row("rounds per minute up: mean", lambda s: s["rounds_per_up_min_mean"]),
        row("rounds per CPU-minute (node + DHT process + p2pd)", lambda s: s["rounds_per_cpu_min"]),
        row("longest network wait of a round", lambda s: wait(s["longest_wait"])),
        row("longest round", lambda s: f"{s['max_round_s']:.1f} s"),
        row("kills / restarts", lambda s: f"{s['kills']} / {s['restarts']}"),
        row("checkpoints that failed to load", lambda s: s["checkpoint_failures"]),
        row(
            "restarts with no resume line (stopped while starting: not counted)",
            lambda s: f"{s['restarts_without_resume_line']} ({s['restarts_stopped_in_startup']})",
        ),
        row("rounds redone after a kill (lost work)", lambda s: s["rounds_redone"]),
        row("peers whose rounds are not 0..n-1 once each", lambda s: s["rounds_not_contiguous"]),
        row(
            "external groups trained on / of them twice by one peer",
            lambda s: f"{s['external_groups_trained']} / {s['groups_trained_twice']}",
        ),
        row(
            "verifier: duplicate / repeated / equivocation / copied_from",
            lambda s: " / ".join(str(s["dup_rejections"][k]) for k in DUP_REASONS),
        ),
        row("rounds in solo (waiting for peers)", lambda s: s["rounds_solo"]),
        row("RSS growth, node process, MB/h (2nd half)", lambda s: rss(s["rss_node_mb_per_h"])),
        row("RSS growth, node + DHT + p2pd, MB/h", lambda s: rss(s["rss_session_mb_per_h"])),
        row("peers that exited on their own", lambda s: s["crashes"]),
        row("kills that left processes behind", lambda s: s["kills_with_survivors"]),
        row("tracebacks on consoles", lambda s: s["console_tracebacks"]),
    ]
    lines += [f"\n{n}: cut short, {sw[n]['cut_short']}" for n in names if sw[n]["cut_short"]]
    if "churn" in sw:
        lines += [
            "",
            f"Churn ratio (churn / calm rounds per peer): {result.get('ratio_rounds', '–')}; "
            f"started on time: {result.get('ratio_rounds_on_time', '–')}.",
            "Bootstrap of the churn swarm: "
            + "; ".join(
                f"{e['t']} s {e['event']}" + (f" (survivors {e['survivors']})" if e.get("survivors") else "")
                for e in sw["churn"]["bootstrap"]
            ),
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=20, help="node processes per swarm")
    ap.add_argument("--minutes", type=float, default=20.0, help="duration of each swarm's run")
    ap.add_argument("--together", action="store_true", help="run calm and churn side by side (needs twice the RAM)")
    ap.add_argument("--swarms", default="calm,churn", help="which swarms, in order")
    ap.add_argument("--netns-peers", type=int, default=4, help="peers per swarm in a network namespace (0: none)")
    ap.add_argument("--loss", type=float, default=0.02, help="packet loss probability each way in a namespace")
    ap.add_argument("--up", default="1mbit", help="tbf rate out of a namespace")
    ap.add_argument("--down", default="8mbit", help="tbf rate into a namespace")
    ap.add_argument("--kill-every", type=float, nargs=2, default=(60.0, 90.0), metavar=("MIN", "MAX"))
    ap.add_argument(
        "--pause",
        type=float,
        nargs=2,
        default=(5.0, 30.0),
        metavar=("MIN", "MAX"),
        help="seconds a killed peer stays down",
    )
    ap.add_argument("--late", type=int, default=3, help="churn peers that start late")
    ap.add_argument("--late-at", type=float, default=300.0, help="when they start (at most a quarter of the run)")
    ap.add_argument("--boot-down", type=float, default=20.0, help="seconds the churn bootstrap stays down")
    ap.add_argument("--sample-s", type=float, default=30.0, help="RSS sampling period")
    ap.add_argument("--stagger", type=float, default=1.0, help="seconds between peer starts")
    ap.add_argument("--pow", type=int, default=8, help="proof-of-work bits of the swarms (8: keys mint at once)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    ap.add_argument("--min-free-gb", type=float, default=1.5, help="end a run early below this MemAvailable")
    ap.add_argument(
        "--node-arg",
        action="append",
        default=["--mixed-precision=off"],
        help="extra sapo-node flag (repeatable; --mixed-precision=off is always first: "
        "docs/benchmarks/churn.md says why; a later --node-arg=--mixed-precision=auto wins)",
    )
    ap.add_argument("--work", default="", help="run dirs here (default: a new temporary directory, kept)")
    ap.add_argument("--out", default="", help="write results.json and report.md here")
    args = ap.parse_args()
    names = [n for n in args.swarms.split(",") if n]
    if not set(names) <= {"calm", "churn"}:
        ap.error("--swarms takes calm and/or churn")
    work = Path(args.work or tempfile.mkdtemp(prefix="sapo-churn-"))
    work.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, _frame) -> None:  # kill -TERM, a closed terminal: cleaned up like Ctrl-C
        print(f"bench_churn: {signal.Signals(signum).name} received", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    per_swarm = min(args.netns_peers, args.peers)
    net = Net(per_swarm * (len(names) if args.together else 1), args.loss, args.up, args.down)
    print(f"bench.churn: work dir {work}; {net.note}", flush=True)
    started, done = time.strftime("%Y-%m-%d %H:%M"), []
    try:
        groups = [names] if args.together else [[n] for n in names]
        for group in groups:
            swarms = []
            for j, name in enumerate(group):
                swarms.append(Swarm(name, args, work, net.hub, net.namespaces[j * per_swarm : (j + 1) * per_swarm]))
            print(f"bench.churn: {', '.join(group)}: {args.peers} peers each for {args.minutes} min", flush=True)
            try:
                run(swarms, args)
            except BaseException:
                for s in swarms:
                    s.kill_everything()
                raise
            done += swarms
    except KeyboardInterrupt:
        print("bench.churn: interrupted; every process stopped, namespaces removed", file=sys.stderr)
        return 130
    finally:
        net.close()
    duration = args.minutes * 60
    result = {
        "command": "python -m scripts.bench.churn " + " ".join(sys.argv[1:]),
        "started": started,
        "minutes": args.minutes,
        "peers": args.peers,
        "together": args.together,
        "net": net.note,
        "node_flags": NODE_FLAGS + args.node_arg,
        "swarms": {s.name: swarm_report(s, duration) for s in done},
    }
    sw = result["swarms"]
    if "calm" in sw and "churn" in sw:
        result["ratio_rounds"] = round(sw["churn"]["rounds_mean"] / sw["calm"]["rounds_mean"], 3)
        result["ratio_rounds_on_time"] = round(sw["churn"]["rounds_mean_on_time"] / sw["calm"]["rounds_mean"], 3)
    report = markdown(result)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "report.md").write_text(report)
    print(f"bench.churn: run dirs kept in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
