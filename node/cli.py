"""`sapo-node`: parse the config, build the node (node/build.py: the swarm exchange and its key first, then the
model), run the round loop (whose start joins the swarm: hivemind's DHT process forks then).

Stopping (docs/OPERATING.md): SIGINT, SIGTERM, SIGHUP and losing the console (stderr's reader gone) all
ask for a graceful stop: the round in progress is abandoned at the next safe point, the last completed
round is checkpointed, exit 0. Repeats within REPEAT_WINDOW_S are the same request (a terminal's Ctrl-C
and a launcher forwarding it arrive together); a third signal, or one after the window, aborts. A stop
during start-up (minting the key's proof of work, loading or converting the model, joining the swarm, the
starting weights' evaluation) ends it within seconds, exit 0: nothing is half-written.

Failures a user can meet (bad flags, a busy run dir, a swarm that refuses to start) are one line on the
console with what to do; their traceback, if any, goes to node.log (debug level), never to the console.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import sys
import time
from pathlib import Path

from node.learn.stop import StartupStopped, StopRequest, until_stopped
from node.ops.config import ConfigError, NodeConfig, build_parser, load_config  # noqa: F401 (build_parser: the parser of sapo-node)
from node.ops.metrics import METRICS_FILE, log_traceback, setup_logging
from node.ops.quick_exit import exit_without_teardown
from node.ops.runlock import RunDirBusy, RunDirLock
from node.ops.stacks import install_stack_dumps

log = logging.getLogger("sapo.cli")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
REPEAT_WINDOW_S = 5.0
ABORT_EXIT_CODE = 130


class StopSignals:
    """Turns stop signals into one StopRequest; only a deliberate later request aborts."""

    def __init__(self, stop: StopRequest):
        self.stop = stop
        self.first_at: float | None = None
        self.count = 0
        self.saved_round = lambda: -1  # set once the node exists: names the checkpoint an abort keeps
        self.starting = ""  # what start-up is doing (a stop then ends it, with no round to abandon)
        self._owner = os.getpid()  # handlers act only in this process, never in a forked child

    def __call__(self, signame: str) -> None:
        now = time.monotonic()
        self.count += 1
        if self.first_at is None:
            self.first_at = now
            if self.starting:
                log.warning("%s: stopping start-up (%s): exiting within seconds", signame, self.starting)
            else:
                log.warning(
                    "%s: stopping at a safe point: the round in progress is abandoned (redone on resume), "
                    "the last completed round is checkpointed. Press Ctrl-C again after %.0f s to abort.",
                    signame,
                    REPEAT_WINDOW_S,
                )
            self.stop.set(signame)
        elif now - self.first_at <= REPEAT_WINDOW_S and self.count < 3:
            log.info("%s again within %.0f s: same stop request, still stopping", signame, REPEAT_WINDOW_S)
        else:
            self.abort(signame)

    def console_lost(self) -> None:
        """stderr's reader went away (terminal closed, `| tee` killed): a graceful stop, never a crash."""
        if not self.stop.is_set():
            log.warning("console closed: stopping at a safe point (node.log keeps the log)")
        self.stop.set("console closed")

    def abort(self, signame: str) -> None:
        """Exit now without waiting for the model thread. Metrics lines and checkpoints are written
        atomically, so the newest complete checkpoint stays valid; only newer rounds are lost."""
        saved = self.saved_round()
        log.error(
            "%s: aborting now; the newest complete checkpoint (%s) stays valid",
            signame,
            f"round {saved}" if saved >= 0 else "none yet",
        )
        logging.shutdown()  # flushes node.log; never blocks on the model thread
        os._exit(ABORT_EXIT_CODE)

    def install_early(self) -> None:
        """Plain handlers until the event loop runs (model loading): a stop then ends the node before round 0.
        Explicit handlers also undo SIGINT inherited as ignored from a script that started us with `&`."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._plain_handler)

    def _plain_handler(self, signum: int, _frame) -> None:
        if os.getpid() != self._owner:  # a forked child (hivemind's DHT process): behave as if we never were
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self(signal.Signals(signum).name)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self, sig.name)

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        """Back to plain handlers while the loop still runs: closing a loop that holds signal handlers resets
        SIGINT to KeyboardInterrupt, and a repeat arriving during the exit would then kill it (exit -2).

        Removing a loop handler resets SIGINT to KeyboardInterrupt for a moment too; a repeat that lands in
        that moment raises it (at the latest from signal.signal, which runs pending handlers first). That is
        the same repeat the plain handler would have counted, so it is counted here and the swap goes on."""
        for sig in STOP_SIGNALS:
            while True:
                try:
                    loop.remove_signal_handler(sig)  # a no-op once removed: a retry only re-installs
                    signal.signal(sig, self._plain_handler)
                    break
                except KeyboardInterrupt:
                    self(signal.SIGINT.name)


def fail(message: str, code: int = 2) -> int:
    print(f"sapo-node: error: {message}", file=sys.stderr)
    return code


def configure_threads(cfg: NodeConfig) -> int:
    """Peers sharing a CPU must not oversubscribe it: one process gets cfg.threads (default: all cores)."""
    import torch

    threads = cfg.threads or max(1, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


def address_problem(cfg: NodeConfig) -> str | None:
    """A multiaddr flag that does not parse, said before anything starts (hivemind would time out on it)."""
    from p2p.maddr import flags_problem

    return flags_problem(cfg.peers, cfg.host_maddrs, cfg.announce_maddrs)


def run_evidence(run_dir: Path) -> str:
    """What shows that `run_dir` holds a run that a fresh start would overwrite ("" if nothing): its metrics, or
    a checkpoint (metrics.jsonl can be lost or deleted while the checkpoints are not)."""
    if (run_dir / METRICS_FILE).exists():
        return METRICS_FILE
    from node.ops.checkpoint import CHECKPOINTS_DIR, round_of  # torch: after the flags' one-line errors

    checkpoints = run_dir / CHECKPOINTS_DIR
    try:
        found = sorted(p.name for p in checkpoints.iterdir() if round_of(p) is not None)
    except OSError:  # none there (or a file of that name: the node's own start says so)
        found = []
    return f"{CHECKPOINTS_DIR}/{found[-1]}" if found else ""


def missing_device(requested: str) -> str | None:
    """Why --device names a CUDA device this machine (or this torch build) lacks; None when it is here. Checked
    up front: moving the model there would end the node in a traceback."""
    import torch

    if not requested.startswith("cuda"):
        return None
    count = torch.cuda.device_count()  # 0 without a GPU or a CUDA build
    if int(requested.partition(":")[2] or 0) < count:
        return None
    build = "" if torch.version.cuda else "; this torch build has no CUDA"
    return f"--device {requested!r} is not available here ({count} CUDA device(s) visible{build})"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # `kill -USR1 <pid>` prints every thread's stack on stderr: what a node that seems stuck is waiting on
    install_stack_dumps()
    try:
        cfg = load_config(argv)
    except ConfigError as exc:
        return fail(str(exc))
    bad_address = address_problem(cfg)
    if bad_address:
        return fail(bad_address)
    run_dir = cfg.run_path
    lock = RunDirLock(run_dir)  # held until the process exits; before anything writes into the run dir
    try:
        lock.acquire()
    except RunDirBusy as exc:
        return fail(str(exc))
    except OSError as exc:  # a file where the run dir belongs, no permission, a full disk
        full = disk_full(exc, run_dir)
        if full:
            return fail(full, 1)
        return fail(f"--run-dir {run_dir}: cannot hold a run there ({exc.strerror or exc}: {exc.filename or run_dir})")
    held = run_evidence(run_dir)
    if held and not cfg.resume:
        return fail(f"{run_dir} already holds a run ({held}); pass --resume to continue it or choose another --run-dir")
    stop = StopRequest()
    signals = StopSignals(stop)
    signals.install_early()
    try:
        setup_logging(run_dir, cfg.log_level, cfg.name, on_console_lost=signals.console_lost)
    except OSError as exc:  # node.log a directory, a read-only run dir, a full disk
        return fail(disk_full(exc, run_dir) or f"cannot write the run dir's log: {exc}", 1)

    from node.learn.tasks import TaskError, resolve_mix

    try:
        mix = resolve_mix(cfg.tasks)
    except TaskError as exc:
        return fail(f"--tasks: {exc}")
    threads = configure_threads(cfg)
    from node import build
    from node.learn.model_io import ModelLoadError, load_model, pick_device
    from p2p.pow import MintStopped

    signals.starting = "setting up this node's swarm identity" if cfg.swarm_enabled else "starting"
    try:
        part = build.practised_part(cfg, mix)  # a --practise the mix lacks: said now, not after the mint
        exchange = build.build_exchange(cfg, mix, stop)  # mints the key's proof of work the first time
    except ConfigError as exc:  # --practise against the mix, flags that only a swarm refuses
        return fail(str(exc))
    except MintStopped:
        return stopped_in_start_up(stop, "minting the key's proof of work; what was tried is kept for the next start")
    except Exception as exc:  # an unreadable identity file, a swarm setting p2p refuses
        log_traceback("the swarm could not be set up")
        return fail(f"cannot set up the swarm: {exc}", 1)
    join_errors: tuple[type[Exception], ...] = ()
    if cfg.swarm_enabled:
        from p2p.transport import TransportError  # hivemind: a silo never imports it

        join_errors = (TransportError,)

    if cfg.require_peers and cfg.peers:  # strict: said before the model loads, not seconds later
        from p2p.membership import PROBE_TIMEOUT_S, no_peer_answered, none_answer

        why = asyncio.run(none_answer(cfg.peers, PROBE_TIMEOUT_S))
        if why is not None:
            log.error("%s", no_peer_answered(why))
            return fail(f"cannot join the swarm: {no_peer_answered(why)}; {join_fix(why)}", 1)
    missing = missing_device(cfg.device)
    if missing:
        return fail(missing)
    device = pick_device(cfg.device)
    log.info("loading model %s on %s (%d CPU threads)", cfg.model, device, threads)
    signals.starting = "loading the model"
    try:
        model, tokenizer = until_stopped(stop, load_model, cfg.model, device)
    except StartupStopped:
        return stopped_in_start_up(stop, "loading the model")
    except ModelLoadError as exc:
        return fail(str(exc), 1)
    signals.starting = "building the node"
    try:
        node = build.build_node(cfg, mix, model, tokenizer, exchange, device, stop=stop)
    except ConfigError as exc:  # flags that only the built parts refuse
        return fail(str(exc))
    except Exception as exc:  # the run dir's files (a file where a directory belongs), --lora-init, --eval-share
        log_traceback("the node could not be built")
        why = f"{type(exc).__name__}: {exc} (the traceback is in {run_dir / 'node.log'})"
        return fail(disk_full(exc, run_dir) or f"cannot build the node: {why}", 1)
    if stop.is_set():
        node.engine.close()
        return stopped_in_start_up(stop, "building the node")
    signals.starting = ""  # from here on the round loop stops itself (joining and the start evaluation too)
    signals.saved_round = lambda: node.persistence.saved_round
    log.info(
        "task mix %s: %s%s | I=%d J=%d G=%d | run dir %s",
        mix.name,
        ", ".join(mix.datasets),
        f" (practising {', '.join(f'{n}:{w:g}' for n, w in part.items())}; peers' groups from all)"
        if cfg.practise
        else "",
        cfg.num_local,
        cfg.num_external,
        cfg.generations,
        run_dir,
    )
    log.info(
        "sampling with %s | %s | mixed precision %s",
        node.engine.name,
        f"LoRA rank {cfg.lora_rank}" if cfg.lora_rank else "full fine-tuning",
        node.precision,
    )
    try:
        asyncio.run(_serve(node, cfg, signals))
    except join_errors as exc:  # --require-peers with no answer, or this machine's side (a port in use)
        log_traceback("the swarm could not be joined")
        return fail(f"cannot join the swarm: {exc}; {join_fix(str(exc), bool(cfg.peers))}", 1)
    except Exception as exc:  # one clear line on the console, the traceback in node.log
        log_traceback("node stopped on an error")
        return fail(
            disk_full(exc, run_dir) or f"{type(exc).__name__}: {exc} (the traceback is in {run_dir / 'node.log'})", 1
        )
    finally:
        # Everything is written and released: a repeat arriving now has nothing left to stop. Ignored, not
        # handled, because interpreter shutdown resets Python-level handlers to the default (death by signal).
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    return 0


def disk_full(exc: BaseException, run_dir: Path) -> str | None:
    """What to do when a disk the node writes to is full (or over its quota); None for any other failure.
    Every write of the node is atomic or append-only, so what it saved before stays loadable (a checkpoint's
    torch.save, which hides the errno, is told apart by the store: node/ops/checkpoint.py)."""
    if not (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return None
    where = exc.filename if isinstance(exc.filename, str) and exc.filename else run_dir
    return (
        f"the disk holding {where} is full: {exc.strerror or os.strerror(exc.errno)}. Every checkpoint and "
        "metrics line written before is intact: free some space, then start again with --resume"
    )


def stopped_in_start_up(stop: StopRequest, what: str) -> int:
    """A stop before the first round: nothing to checkpoint, a clean exit."""
    log.info("stopped during start-up (%s) after %s: no round was started; start again to go on", what, stop.reason)
    return 0


class StatusUnavailable(RuntimeError):
    """The status server could not listen where --status-host and --status-port say."""


def join_fix(message: str, peers: bool = True) -> str:
    """What to do about a swarm that did not start, from what failed (`peers`: --peers named some)."""
    low = message.lower()
    if "already in use" in low or "failed to listen" in low or "cannot assign" in low:
        return "another process holds that address: choose another port in --host-maddrs, or stop that process"
    if "already taken by another peer" in low:
        return "another node runs with this run dir's libp2p identity (p2p.identity): stop it or use another --run-dir"
    if not peers:  # nothing to reach: the DHT peer itself did not come up
        return "check --host-maddrs and --announce-maddrs, and node.log's last lines (debug level) for p2pd's error"
    return (
        "check that the peers in --peers run and are reachable from here (address, port, firewall), or leave "
        "out --require-peers to train in silo until one answers"
    )


async def _serve(node, cfg: NodeConfig, signals: StopSignals) -> None:
    signals.install(asyncio.get_running_loop())
    status = None
    if cfg.status_port:
        from node.ops.status import start_status_server

        try:
            status = await start_status_server(node.snapshot, host=cfg.status_host, port=cfg.status_port)
        except OSError as exc:  # an address this machine lacks, a port in use
            raise StatusUnavailable(f"--status-host/--status-port {cfg.status_host}:{cfg.status_port}: {exc}") from exc
        log.info("status on http://%s:%d/", cfg.status_host, status.port)
    try:
        done = await node.run()
        if node.stop_requested:
            last = (
                f"last completed round {node.next_round - 1} is checkpointed"
                if node.next_round > 0
                else "no round completed yet"
            )
            log.info(
                "stopped after a request (%s): %d rounds this run; %s; resume with --resume",
                node.stop.reason,
                done,
                last,
            )
        else:
            log.info("finished: %d rounds this run, next round %d", done, node.next_round)
    finally:
        signals.uninstall(asyncio.get_running_loop())
        if status is not None:
            await status.stop()


def run() -> None:
    """The `sapo-node` command: main(), then an exit without the interpreter's 2 s teardown of torch."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
