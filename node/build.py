"""One place that turns a `NodeConfig` into a node: the settings each part takes (training, sampling,
verification), the swarm exchange, and the `SapoNode` with all its parts. The CLI, the experiment runner,
the benchmarks and the tests build nodes here, so that a flag means the same wherever a node runs.

Order matters in `build_node`: the base model's fingerprint is taken before any weight is cast or trained,
and torch's RNG is seeded last, so whatever building draws, the first round samples the same.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from node.learn import precision
from node.learn.engines import eval_engine, make_engine
from node.learn.eval_share import EvalShare
from node.learn.evaluate import HeldOutEval
from node.learn.groups import Prompter
from node.learn.guard import CollapseGuard, GuardConfig
from node.learn.lora import Adapter, attach
from node.learn.practise import practised
from node.learn.sampling import SamplingConfig
from node.learn.screen import ExternalScreen, ScreenConfig
from node.learn.stop import StopRequest
from node.learn.tasks import TaskMix, TaskSampler
from node.learn.trainer import TrainConfig, Trainer
from node.loop import SapoNode
from node.ops.checkpoint import CHECKPOINTS_DIR
from node.ops.config import ConfigError, NodeConfig
from node.ops.metrics import METRICS_FILE, MetricsWriter
from node.ops.tensorboard import TensorBoardLog
from node.persistence import Persistence, weights_base
from node.records import NodeTotals
from node.swarm.exchange import Exchange, Silo
from node.swarm.ij_controller import make_ij_controller
from node.swarm.memory_exchange import MemoryExchange
from node.swarm.pipeline import NetPipeline, pipelined
from node.swarm.settings import SwarmFiles, SwarmSettings
from node.swarm.verify import VerifyConfig
from p2p.wire import WireCaps


def sampling_config(cfg: NodeConfig, mix: TaskMix) -> SamplingConfig:
    """How completions are drawn; --max-new-tokens 0 takes the task mix's own length."""
    return SamplingConfig(cfg.temperature, cfg.top_p, cfg.max_new_tokens or mix.max_new_tokens)


def train_config(cfg: NodeConfig, max_completion_len: int) -> TrainConfig:
    """One GRPO update's settings; `max_completion_len` (the sampling limit) is dr_grpo's normaliser."""
    return TrainConfig(
        lr=cfg.lr,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        beta=cfg.beta,
        loss_type=cfg.loss_type,
        scale_std=cfg.scale_std,
        max_grad_norm=cfg.max_grad_norm,
        epochs=cfg.epochs,
        minibatches=cfg.minibatches,
        micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.temperature,
        max_completion_len=max_completion_len,
        prefix_sharing=cfg.prefix_sharing,
    )


def swarm_settings(cfg: NodeConfig) -> SwarmSettings:
    """The swarm's share of the flags, its files in the run dir. A run dir that already holds a run (metrics
    or checkpoints) keeps its identity: a missing key there is an error, never a new identity."""
    run_dir = cfg.run_path
    has_state = (run_dir / METRICS_FILE).exists() or (run_dir / CHECKPOINTS_DIR).exists()
    return SwarmSettings(
        swarm=cfg.swarm,
        model=cfg.model,
        files=SwarmFiles.in_dir(run_dir),
        create_identity=not has_state,
        seed=cfg.seed,
        peers=tuple(cfg.peers),
        require_peers=cfg.require_peers,
        host_maddrs=tuple(cfg.host_maddrs),
        announce_maddrs=tuple(cfg.announce_maddrs),
        client_mode=cfg.client_mode,
        window=cfg.window,
        net_timeout_s=cfg.net_timeout,
        verify_budget_s=cfg.verify_budget_s,
        verify_budget_mb=cfg.verify_budget_mb,
        fetch_max=cfg.fetch_max,
        pow_difficulty=cfg.pow_difficulty,
        identity_tier=cfg.identity_tier,
        ban_s=cfg.ban_s,
        external_screen=cfg.external_screen,
    )


def verify_config(cfg: NodeConfig, **overrides: Any) -> VerifyConfig:
    """What a received batch is checked against, and the verifier's per-round budgets (for exchanges built
    outside `build_exchange`: memory mode's)."""
    return VerifyConfig.from_settings(swarm_settings(cfg), **overrides)


def practised_part(cfg: NodeConfig, mix: TaskMix) -> dict[str, float]:
    """The datasets the node samples its own tasks from, with their weights (--practise; unset: the whole mix).
    ConfigError when the resolved mix lacks one: the CLI asks before the model loads."""
    try:
        return practised(mix, cfg.practise)
    except ValueError as exc:
        raise ConfigError(f"--practise {exc}") from None


def check_fits_the_wire(cfg: NodeConfig) -> None:
    """Refuse group shapes that every receiver refuses (p2p.wire.WireCaps): published, each batch would be an
    offence, and the node would be banned by its whole swarm without an error of its own."""
    caps = WireCaps()
    if cfg.generations > caps.max_completions:
        raise ConfigError(
            f"--generations must be <= {caps.max_completions} in a swarm: peers refuse larger groups "
            f"(got {cfg.generations})"
        )
    if cfg.num_local > caps.max_groups:
        raise ConfigError(
            f"--num-local must be <= {caps.max_groups} in a swarm: peers refuse batches of more "
            f"groups (got {cfg.num_local})"
        )


def build_exchange(cfg: NodeConfig, mix: TaskMix, stop: StopRequest | None = None) -> Exchange:
    """The swarm: a Silo without --peers or --swarm-start, else the Hivemind DHT (its identity minted here the
    first time: p2p.pow.MintStopped if `stop` is requested meanwhile). It joins at the node's start."""
    if not cfg.swarm_enabled:
        return Silo()
    check_fits_the_wire(cfg)
    from node.swarm.dht_exchange import DhtExchange

    return DhtExchange.create(swarm_settings(cfg), mix, stop)


def build_node(
    cfg: NodeConfig,
    mix: TaskMix,
    model: torch.nn.Module,
    tokenizer,
    exchange: Exchange,
    device: torch.device,
    stop: StopRequest | None = None,
    adapter: Adapter | None = None,
) -> SapoNode:
    """A node on `model`: with --lora-rank a LoRA adapter is attached to it here, unless `adapter` is given
    (peers of one process sharing a base: `model` is then the adapter's wrapper)."""
    stop = stop or StopRequest()
    part = practised_part(cfg, mix)  # before anything is attached to the model
    if adapter is None and cfg.lora_rank > 0:
        adapter = attach(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
    model = adapter.model if adapter is not None else model
    base_id = weights_base(model, adapter)  # what a checkpoint belongs to: before any training or cast
    sampling = sampling_config(cfg, mix)
    trainer = Trainer(
        model,
        tokenizer.pad_token_id,
        train_config(cfg, sampling.max_new_tokens),
        seed=cfg.seed,
        stop=stop,
        adapter=adapter,
        screen=ExternalScreen(ScreenConfig(cfg.external_screen)),
    )
    mode = precision.resolve(cfg.mixed_precision, device)
    if adapter is not None and mode == "bf16":
        adapter.base.store_frozen_weights_as(torch.bfloat16)  # cast once, not in every forward
    engine = make_engine(
        cfg.rollout_engine, model, tokenizer, cfg.model, weight_type=cfg.engine_weights, logp_exact=mode == "off"
    )
    sampler = TaskSampler(mix, cfg.seed, part)
    select_rng = random.Random(cfg.seed + 1)
    ij = make_ij_controller(cfg.ij_policy, total=cfg.num_local + cfg.num_external, initial_j=cfg.num_external)
    totals = NodeTotals()
    guard = CollapseGuard(GuardConfig(enabled=cfg.collapse_guard, lr_factor=cfg.guard_lr_factor))
    metrics = MetricsWriter(cfg.run_path)
    persistence = Persistence(
        cfg,
        model=model,
        adapter=adapter,
        base_id=base_id,
        trainer=trainer,
        sampler=sampler,
        select_rng=select_rng,
        ij=ij,
        totals=totals,
        metrics=metrics,
        reputation=exchange.reputation,
        device=device,
        guard=guard,
    )
    held_out = HeldOutEval(
        mix,
        cfg.eval_size,
        cfg.eval_every,
        cfg.rounds,
        cfg.eval_unseen_size,
        at=cfg.eval_rounds,
        engine=eval_engine(cfg.eval_engine, engine, mode),
        round0=cfg.eval_round0,
        practised=frozenset(part) if cfg.practise else frozenset(),
    )
    if cfg.eval_share:  # what else the answers depend on: peers that differ in any of it never share
        evaluator = held_out.engine.name if held_out.engine is not None else "torch"
        spec = f"{cfg.model}|{mix!r}|{cfg.eval_size}|{cfg.eval_unseen_size}|{sampling.max_new_tokens}|{evaluator}"
        share = EvalShare(Path(cfg.eval_share), f"{spec}|{mode}|{torch.get_num_threads()}|{device}")
        held_out.share_first = share.evaluate
    node = SapoNode(
        cfg=cfg,
        mix=mix,
        model=model,
        tokenizer=tokenizer,
        device=device,
        adapter=adapter,
        precision=mode,
        engine=engine,
        sampling=sampling,
        prompter=Prompter(tokenizer, mix),
        sampler=sampler,
        select_rng=select_rng,
        trainer=trainer,
        ij=ij,
        exchange=exchange,
        net=NetPipeline(
            exchange,
            stop,
            cfg.net_timeout,
            background=pipelined(cfg.net_pipeline, in_process=isinstance(exchange, (Silo, MemoryExchange))),
            max_age=cfg.net_max_age,
        ),
        held_out=held_out,
        totals=totals,
        metrics=metrics,
        tensorboard=TensorBoardLog(cfg.run_path, enabled=cfg.tensorboard),
        persistence=persistence,
        guard=guard,
        stop=stop,
    )
    torch.manual_seed(cfg.seed)
    return node
