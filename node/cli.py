"""`sapo-node`: parse the config, build the pieces (swarm first: hivemind forks), run the round loop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from node.ops.config import ConfigError, NodeConfig, load_config
from node.ops.metrics import METRICS_FILE, setup_logging

log = logging.getLogger("sapo.cli")


def fail(message: str, code: int = 2) -> int:
    print(f"sapo-node: error: {message}", file=sys.stderr)
    return code


def configure_threads(cfg: NodeConfig) -> int:
    """Peers sharing a CPU must not oversubscribe it: one process gets cfg.threads (default: all cores)."""
    import torch

    threads = cfg.threads or max(1, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


def build_exchange(cfg: NodeConfig, mix):
    if not cfg.swarm_enabled:
        from node.swarm.exchange import Silo

        return Silo()
    from node.swarm.dht_exchange import DhtExchange

    return DhtExchange.from_config(cfg, mix)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = load_config(argv)
    except ConfigError as exc:
        return fail(str(exc))
    run_dir = cfg.run_path
    if (run_dir / METRICS_FILE).exists() and not cfg.resume:
        return fail(f"{run_dir} already holds a run ({METRICS_FILE}); pass --resume to continue it "
                    "or choose another --run-dir")
    setup_logging(run_dir, cfg.log_level, cfg.name)

    from node.learn.tasks import TaskError, resolve_mix

    try:
        mix = resolve_mix(cfg.tasks)
    except TaskError as exc:
        return fail(f"--tasks: {exc}")
    threads = configure_threads(cfg)
    try:
        exchange = build_exchange(cfg, mix)  # before any CUDA work: hivemind's DHT forks a process
    except Exception as exc:
        return fail(f"cannot join the swarm: {exc}", 1)

    from node.loop import SapoNode
    from node.learn.policy import ModelLoadError, load_model, pick_device

    device = pick_device(cfg.device)
    log.info("loading model %s on %s (%d CPU threads)", cfg.model, device, threads)
    try:
        model, tokenizer = load_model(cfg.model, device)
    except ModelLoadError as exc:
        return fail(str(exc), 1)
    node = SapoNode(cfg, mix, model, tokenizer, exchange, device)
    log.info("task mix %s: %s | I=%d J=%d G=%d | run dir %s", mix.name, ", ".join(mix.datasets),
             cfg.num_local, cfg.num_external, cfg.generations, run_dir)
    try:
        asyncio.run(_serve(node, cfg))
    except Exception as exc:  # one clear line on the console, the traceback in node.log
        log.exception("node stopped on an error")
        return fail(f"{type(exc).__name__}: {exc}", 1)
    return 0


async def _serve(node, cfg: NodeConfig) -> None:
    loop = asyncio.get_running_loop()

    def request_stop(signame: str) -> None:
        if node.stop_requested:
            log.warning("%s again: aborting now; the newest complete checkpoint stays valid", signame)
            os._exit(130)
        log.warning("%s: finishing the current round, then checkpoint and exit (again to abort)", signame)
        node.stop_requested = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, request_stop, sig.name)
    status = None
    if cfg.status_port:
        from node.ops.status import start_status_server

        status = await start_status_server(node.snapshot, host=cfg.status_host, port=cfg.status_port)
        log.info("status on http://%s:%d/", cfg.status_host, status.port)
    try:
        done = await node.run()
        log.info("finished: %d rounds this run, next round %d", done, node.next_round)
    finally:
        if status is not None:
            await status.stop()


if __name__ == "__main__":
    sys.exit(main())
