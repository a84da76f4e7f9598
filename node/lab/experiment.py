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
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from node import __version__
from node.cli import REPEAT_WINDOW_S
from node.lab.plan import MAX_SEED, dht_flags, peer_env, place_problem, plan_runs, run_dir_of, run_flags
from node.lab.run_record import (
    RunJsonError,
    is_complete,
    provenance,
    settings_changed,
    write_run_json,
)
from node.lab.runspec import (
    PRESETS,
    RunSpec,
    label_problem,
    recipe_env,
    slug,
    unused_settings,
)
from node.learn.choices import EVAL_ENGINES
from node.learn.stop import RoundAbandoned, StopRequest
from node.ops.config import ConfigError
from node.ops.quick_exit import exit_without_teardown
from node.ops.runlock import RunDirBusy, RunDirLock

log = logging.getLogger("sapo.experiment")


def prune_checkpoints(root: Path) -> int:
    """Delete the peers' checkpoints of a finished run; returns bytes freed. A 135M model with Adam
    state is ~1.5 GB per peer, so a 3 x 3 comparison would otherwise keep ~70 GB nobody reads."""
    freed = 0
    for ckpt in root.glob("peer*/checkpoints"):
        freed += sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        shutil.rmtree(ckpt, ignore_errors=True)
    return freed


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
            spec.node_args(p, peer_dir) + run_flags(spec, root) + (["--resume"] if resume else []), env=recipe_env()
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

CONSOLE_FILE = "console.log"  # what a dht-mode peer printed (stdout and stderr), appended start after start: a
# peer that fails before its node.log exists says why here


def last_line(path: Path, start: int) -> str:
    """The last non-empty line written to `path` after byte `start` ("" if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


def run_dht(spec: RunSpec, root: Path, poll_s: float = 1.0) -> bool:
    env = peer_env(spec)
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
        starts = []  # where each peer's output of this start begins in its console.log
        for p in range(spec.peers):
            peer_dir = root / f"peer{p}"
            peer_dir.mkdir(parents=True, exist_ok=True)
            args = spec.node_args(p, peer_dir) + run_flags(spec, root) + dht_flags(maddrs)
            if (peer_dir / "metrics.jsonl").exists():
                args.append("--resume")
            with open(peer_dir / CONSOLE_FILE, "ab") as console:
                starts.append(console.tell())
                # own session: a terminal's Ctrl-C reaches this process only, which asks each peer once
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "node.cli", *args],
                        env=env,
                        stdout=console,
                        stderr=subprocess.STDOUT,
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
        for p, (code, start) in enumerate(zip(codes, starts)):
            if code not in (0, None):
                console_file = root / f"peer{p}" / CONSOLE_FILE
                log.warning(
                    "%s seed %d: peer%d exited %s: %s (its output: %s)",
                    spec.config_name,
                    spec.seed,
                    p,
                    code,
                    last_line(console_file, start) or "nothing printed",
                    console_file,
                )
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
    ap.add_argument("--peers", type=int, default=None, help="override the preset's peer count (>= 1)")
    ap.add_argument("--generations", type=int, default=None, help="override the preset's G (>= 2)")
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


def fail(message: str, code: int = 2) -> int:
    print(f"sapo-experiment: error: {message}", file=sys.stderr)
    return code


def keep_traceback(root: Path) -> str:
    """The traceback of the exception being handled, appended to ROOT/errors.log: the console gets one line, and
    this text to add to it (empty when it could not be written)."""
    path = root / "errors.log"
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n{traceback.format_exc()}\n")
    except OSError:
        return ""
    return f" (the traceback is in {path})"


def record_status(root: Path, spec: RunSpec, status: str, prov: dict) -> None:
    """run.json's status now; a run.json that cannot be written is said, not raised (the run's outcome stands)."""
    try:
        write_run_json(root / "run.json", spec, status, prov)
    except (OSError, RunJsonError) as exc:
        log.error("%s seed %d: cannot record %r in run.json: %s", spec.config_name, spec.seed, status, exc)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [c for c in args.configs if c not in PRESETS]
    if unknown:
        return fail(f"unknown configuration(s) {unknown}; presets: {', '.join(PRESETS)}")
    if args.label and len(args.configs) != 1:
        return fail("--label names one configuration")
    bad_label = label_problem(args.label) if args.label else None
    if bad_label:
        return fail(bad_label)
    if args.rounds < 1:  # --lora-rank and the other node settings: each peer's flags, checked in plan_runs
        return fail(f"--rounds must be >= 1 (got {args.rounds})")
    bad_seeds = [s for s in args.seeds if not 0 <= s <= MAX_SEED]
    if bad_seeds:
        return fail(f"--seeds must be in [0, {MAX_SEED}] (got {bad_seeds[0]})")
    exp = Path(args.out)
    try:
        runs = plan_runs(args)
    except ValueError as exc:
        return fail(str(exc))
    problem = place_problem(exp, [run_dir_of(exp, spec) for _, spec in runs])
    if problem:
        return fail(problem)
    try:
        exp.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return fail(f"--out {exp}: cannot create it ({exc.strerror or exc})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    unused = unused_settings(os.environ)
    if unused:
        log.warning(
            "%s: set here, passed to no peer (in either mode); give a setting as --node-arg=--NAME=VALUE, which "
            "run.json records",
            ", ".join(unused),
        )
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
    failed: list[str] = []
    for name, spec in runs:
        seed, peers = spec.seed, spec.peers
        root = run_dir_of(exp, spec)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.error("%s seed %d: cannot create its run dir %s (%s)", name, seed, root, exc.strerror or exc)
            failed.append(f"{name} seed {seed}")
            continue
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
        log.info("%s seed %d: %d peers x %d rounds (%s mode) in %s", name, seed, peers, args.rounds, args.mode, root)
        t0 = time.time()
        try:
            write_run_json(root / "run.json", spec, "running", prov)
            ok = asyncio.run(run_memory(spec, root)) if args.mode == "memory" else run_dht(spec, root)
            status = "complete" if ok else "interrupted" if Stop.node_stop.is_set() else "failed"
        except KeyboardInterrupt:  # a second Ctrl-C, REPEAT_WINDOW_S after the first: abort now
            record_status(root, spec, "interrupted", prov)
            return fail(f"{name} seed {seed}: aborted; the same command resumes it from its checkpoints", 130)
        except ConfigError as exc:  # what only a built node refuses: every run would
            record_status(root, spec, "failed", prov)
            return fail(f"{name} seed {seed}: {exc}")
        except Exception as exc:  # one line; a model that does not load (memory mode), a bootstrap that fails
            status = "interrupted" if Stop.node_stop.is_set() else "failed"
            log.error("%s seed %d: %s: %s%s", name, seed, type(exc).__name__, exc, keep_traceback(root))
        record_status(root, spec, status, prov)
        log.info("%s seed %d: %s in %.0fs", name, seed, status, time.time() - t0)
        if status == "failed":
            failed.append(f"{name} seed {seed}")
        if status == "complete" and not args.keep_run_checkpoints:
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
    if failed:
        return fail(
            f"{len(failed)} of {len(runs)} runs failed ({', '.join(failed)}): the lines above say why, their "
            "run.json says failed; the same command runs them again",
            1,
        )
    log.info("all runs complete; report: sapo-report %s; curves: tensorboard --logdir %s", exp, exp)
    return 0


def run() -> None:
    """The `sapo-experiment` command: main(), then an exit without the interpreter's teardown of torch."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
