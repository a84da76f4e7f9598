"""The SAPO round loop. Each round, on this node, independently of every other node:

    1. sample I tasks                       5. collect verified external groups (window of recent rounds)
    2. generate G completions per task      6. select: drop zero-advantage groups, keep I local + J external
    3. score them with our own reward       7. one GRPO update (pi_old fixed before the first step)
    4. publish the groups to the swarm      8. metrics, adapt I/J, checkpoint (every --eval-every: held-out eval)

Model work runs in a single worker thread; the event loop only awaits it, so swarm I/O, the status
server and signal handling stay responsive.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from node import __version__
from node.ops.checkpoint import CheckpointStore
from node.ops.config import NodeConfig
from node.swarm.exchange import Exchange
from node.learn.evaluate import HeldOutEval
from node.learn.groups import Group, Prompter, collapse_metrics, local_group, select_groups, to_sequences
from node.swarm.ij_policy import RoundObservation, make_ij_policy
from node.ops.metrics import MetricsWriter, peak_memory_mb
from node.learn.policy import SamplingConfig, sample_groups
from node.learn.tasks import TaskMix, TaskSampler
from node.learn.trainer import StepStats, TrainConfig, Trainer

log = logging.getLogger("sapo.node")


@dataclass
class RoundResult:
    round: int
    record: dict[str, Any]


@dataclass
class NodeTotals:
    rounds: int = 0
    tokens_generated: int = 0
    groups_local: int = 0
    groups_external: int = 0
    dropped_zero_adv: int = 0


@dataclass
class LiveState:
    """What the status server and progress view read; updated by the loop, never blocking it."""

    phase: str = "starting"
    round: int = 0
    started_at: float = field(default_factory=time.time)
    history: list = field(default_factory=list)
    last_round_at: float | None = None
    last_eval: dict | None = None  # the newest held-out evaluation: round, accuracy, per dataset, seconds


class SapoNode:
    def __init__(self, cfg: NodeConfig, mix: TaskMix, model: torch.nn.Module, tokenizer, exchange: Exchange,
                 device: torch.device):
        self.cfg = cfg
        self.mix = mix
        self.model = model
        self.tokenizer = tokenizer
        self.exchange = exchange
        self.device = device
        self.run_dir = cfg.run_path
        self.sampling = SamplingConfig(cfg.temperature, cfg.top_p, cfg.max_new_tokens or mix.max_new_tokens)
        self.trainer = Trainer(model, tokenizer.pad_token_id, TrainConfig(
            lr=cfg.lr, eps_low=cfg.eps_low, eps_high=cfg.eps_high, beta=cfg.beta, loss_type=cfg.loss_type,
            scale_std=cfg.scale_std, max_grad_norm=cfg.max_grad_norm, epochs=cfg.epochs,
            minibatches=cfg.minibatches, micro_batch_size=cfg.micro_batch_size, temperature=cfg.temperature,
            max_completion_len=self.sampling.max_new_tokens, prefix_sharing=cfg.prefix_sharing), seed=cfg.seed)
        self.prompter = Prompter(tokenizer, mix)
        self.sampler = TaskSampler(mix, cfg.seed)
        self.select_rng = random.Random(cfg.seed + 1)
        total = cfg.num_local + cfg.num_external
        self.ij = make_ij_policy(cfg.ij_policy, total=total, initial_j=cfg.num_external)
        self.store = CheckpointStore(self.run_dir, keep=cfg.keep_checkpoints)
        self.metrics = MetricsWriter(self.run_dir)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.next_round = 0
        self.rounds_this_run = 0
        self.totals = NodeTotals()
        self.live = LiveState()
        self.stop_requested = False
        self.held_out = HeldOutEval(mix, cfg.eval_size, cfg.eval_every, cfg.rounds)
        torch.manual_seed(cfg.seed)

    # --- the algorithm ----------------------------------------------------------------------------------

    async def run(self) -> int:
        """Runs rounds until cfg.rounds (in total) or a stop request; returns the rounds completed now."""
        await self.open()
        try:
            while self.pending and not self.stop_requested:
                await self.step()
        finally:
            await self.close()
        return self.rounds_this_run

    async def open(self) -> None:
        await self.exchange.start()
        if self.cfg.resume:
            await self._in_worker(self.resume)

    @property
    def pending(self) -> bool:
        return self.next_round < self.cfg.rounds

    async def step(self) -> dict:
        """One round, then a checkpoint every --checkpoint-every rounds."""
        result = await self.run_round(self.next_round)
        self.next_round = result.round + 1
        self.rounds_this_run += 1
        if self.next_round % self.cfg.checkpoint_every == 0 and self.pending:
            await self._checkpoint()
        return result.record

    async def close(self) -> None:
        """Final checkpoint (if anything ran), then release the swarm and the worker."""
        try:
            if self.rounds_this_run:
                await self._checkpoint()
        finally:
            await self.exchange.close()
            self.worker.shutdown(wait=True)
            self.live.phase = "stopped"

    async def run_round(self, r: int) -> RoundResult:
        timer = PhaseTimer(self.live)
        total = self.cfg.num_local + self.cfg.num_external
        if self.cfg.ij_policy == "fixed":
            num_local, num_external = self.cfg.num_local, self.cfg.num_external
        else:  # I + J stays fixed; at least one local group so this node always contributes to the swarm
            num_external = min(self.ij.current_j(), total - 1)
            num_local = total - num_external
        self.live.round = r

        with timer("sample"):
            tasks = self.sampler.sample(num_local)
        with timer("generate"):
            prompts = [self.prompter(t) for t in tasks]
            sampled = await self._in_worker(sample_groups, self.model, self.tokenizer, prompts,
                                            self.cfg.generations, self.sampling)
        with timer("score"):
            local = await self._in_worker(
                lambda: [local_group(t, s, self.mix.answer_prefix) for t, s in zip(tasks, sampled)])
        with timer("publish"):
            await self._bounded(self.exchange.publish(r, local), "publish")
        with timer("fetch"):
            external = await self._bounded(self.exchange.collect(r), "fetch") or []
        with timer("select"):
            selection = select_groups(local, external, num_local, num_external, self.select_rng)
        with timer("train"):
            stats = await self._in_worker(self.train, selection.local + selection.external)

        record = self._record(r, timer, local, selection, stats, num_local, num_external, sampled)
        record.update(collapse_metrics(local, external))
        if self.held_out.due(r):
            with timer("eval"):
                result = await self._in_worker(self.held_out.run, self.model, self.tokenizer, self.prompter,
                                               self.sampling.max_new_tokens)
            self.live.last_eval = {"round": r, **result.to_record()}
            record.update(result.to_record(), t_end=time.time(), round_s=round(time.time() - timer.t0, 4))
            record["phase_s"]["eval"] = round(timer.seconds["eval"], 4)
            log.info("held-out accuracy %.3f after round %d (%d tasks, greedy, %.1fs)", result.accuracy, r, result.size,
                     result.seconds)
        self.ij.update(self._observation(r, local, external, selection, record))
        self.metrics.write(record)
        self._log_round(record)
        return RoundResult(r, record)

    def train(self, groups: list[Group]) -> StepStats:
        seqs = to_sequences(groups, self.tokenizer, self.prompter, self.cfg.scale_std)
        return self.trainer.step(seqs)

    # --- helpers ------------------------------------------------------------------------------------------

    async def _in_worker(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    async def _bounded(self, coro, what: str):
        """A round never waits on the network longer than --net-timeout."""
        try:
            return await asyncio.wait_for(coro, timeout=self.cfg.net_timeout)
        except asyncio.TimeoutError:
            log.warning("%s took longer than --net-timeout %.1fs; going on without it", what, self.cfg.net_timeout)
        except Exception as exc:  # the swarm must never crash the node
            log.warning("%s failed: %s", what, exc)
        return None

    def _record(self, r, timer, local, selection, stats: StepStats, num_local, num_external, sampled) -> dict:
        rewards = [x for g in local for x in g.rewards]
        tokens = sum(len(ids) for s in sampled for ids in s.completion_ids)
        ex_stats = self.exchange.stats
        self.totals.rounds += 1
        self.totals.tokens_generated += tokens
        self.totals.groups_local += len(selection.local)
        self.totals.groups_external += len(selection.external)
        self.totals.dropped_zero_adv += selection.dropped_local + selection.dropped_external
        phase_s = {k: round(v, 4) for k, v in timer.seconds.items()}
        return {
            "round": r,
            "t_start": timer.t0,
            "t_end": time.time(),
            "round_s": round(time.time() - timer.t0, 4),
            "phase_s": phase_s,
            "swarm_io_s": round(phase_s.get("publish", 0.0) + phase_s.get("fetch", 0.0), 4),
            "reward_mean": float(sum(rewards) / len(rewards)) if rewards else 0.0,
            "reward_max": float(max(rewards)) if rewards else 0.0,
            "local_signal_frac": (len(local) - selection.dropped_local) / max(len(local), 1),
            "target_local": num_local,
            "target_external": num_external,
            "num_local": len(selection.local),
            "num_external": len(selection.external),
            "dropped_zero_adv_local": selection.dropped_local,
            "dropped_zero_adv_external": selection.dropped_external,
            "external_available": selection.external_available,
            "external_accepted": ex_stats.round_accepted,
            "external_rejected": sum(ex_stats.round_rejected.values()),
            "rejected_by_reason": dict(ex_stats.round_rejected),
            "external_sources": _count_sources(selection.external),
            "loss": stats.loss,
            "clip_frac": stats.clip_frac,
            "ratio_mean": stats.ratio_mean,
            "grad_norm": stats.grad_norm,
            "optimizer_steps": stats.optimizer_steps,
            "tokens_generated": tokens,
            "peak_mem_mb": round(peak_memory_mb(self.device), 1),
            "ij_policy": self.cfg.ij_policy,
        }

    def _observation(self, r, local, external, selection, record) -> RoundObservation:
        return RoundObservation(
            round=r,
            reward_mean=record["reward_mean"],
            num_local=record["num_local"],
            num_external=record["num_external"],
            external_available=selection.external_available,
            local_signal_frac=record["local_signal_frac"],
            external_signal_frac=selection.external_available / len(external) if external else 0.0,
            external_adv_abs_mean=_mean_abs_adv(selection.external),
            local_adv_abs_mean=_mean_abs_adv(selection.local),
        )

    def _log_round(self, rec: dict) -> None:
        p = rec["phase_s"]
        self.live.history.append({k: rec[k] for k in ("round", "reward_mean", "num_local", "num_external")}
                                 | {"phase_s": p} | {k: rec[k] for k in HISTORY_EXTRA if k in rec})
        del self.live.history[:-500]
        self.live.last_round_at = rec["t_end"]
        log.info(
            "round %d | reward %.3f (max %.2f) | local %d/%d ext %d/%d (avail %d, got %d, rej %d) | dropped %d "
            "| loss %+.4f clip %.3f | gen %.1fs train %.1fs swarm %.2fs",
            rec["round"], rec["reward_mean"], rec["reward_max"], rec["num_local"], rec["target_local"],
            rec["num_external"], rec["target_external"], rec["external_available"], rec["external_accepted"],
            rec["external_rejected"], rec["dropped_zero_adv_local"] + rec["dropped_zero_adv_external"],
            rec["loss"], rec["clip_frac"], p.get("generate", 0), p.get("train", 0), rec["swarm_io_s"],
        )

    # --- checkpoint / resume ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {
            "next_round": self.next_round,
            "sampler": self.sampler.state_dict(),
            "select_rng": _py_rng_state(self.select_rng),
            "trainer_rng": _py_rng_state(self.trainer.rng),
            "torch_rng": torch.random.get_rng_state().tolist(),
            "ij_policy": self.ij.state_dict(),
            "totals": vars(self.totals),
            "config": self.cfg.to_dict(),
            "version": __version__,
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        return state

    async def _checkpoint(self) -> None:
        self.live.phase = "checkpoint"
        t0 = time.time()
        path = await self._in_worker(lambda: self.store.save(
            self.next_round - 1, self.model, self.trainer.optimizer, self.state_dict()))
        log.info("checkpoint %s written in %.1fs", path.name, time.time() - t0)

    def resume(self) -> None:
        ckpt = self.store.load_latest(map_location=self.device)
        if ckpt is None:
            log.warning("--resume: no checkpoint in %s yet; starting at round 0", self.store.dir)
            return
        self.model.load_state_dict(ckpt.model)
        self.trainer.optimizer.load_state_dict(ckpt.optimizer)
        s = ckpt.state
        self.next_round = int(s["next_round"])
        self.sampler.load_state_dict(s["sampler"])
        self.select_rng.setstate(_to_py_rng(s["select_rng"]))
        self.trainer.rng.setstate(_to_py_rng(s["trainer_rng"]))
        torch.random.set_rng_state(torch.tensor(s["torch_rng"], dtype=torch.uint8))
        if "cuda_rng" in s and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(x, dtype=torch.uint8) for x in s["cuda_rng"]])
        self.ij.load_state_dict(s["ij_policy"])
        self.totals = NodeTotals(**s["totals"])
        moved = self.metrics.truncate_after(self.next_round - 1)
        log.info("resumed from %s: next round %d%s", ckpt.path.name, self.next_round,
                 f" ({moved} metrics lines after it moved to metrics.orphaned.jsonl)" if moved else "")

    # --- status ---------------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe status for /status, /metrics and the dashboard."""
        rewards = [h["reward_mean"] for h in self.live.history]
        ma = rewards[-20:]
        info = self.exchange.identity_info()
        last = self.live.history[-1] if self.live.history else None
        stats = self.exchange.stats
        return {
            **info,
            "swarm": self.cfg.swarm if self.cfg.swarm_enabled else "silo",
            "model": self.cfg.model,
            "version": __version__,
            "round": self.live.round,
            "phase": self.live.phase,
            "uptime_s": time.time() - self.live.started_at,
            "started_at": self.live.started_at,
            "last_reward": rewards[-1] if rewards else None,
            "reward_ma": sum(ma) / len(ma) if ma else None,
            "phase_s": last["phase_s"] if last else {},
            "history": list(self.live.history),
            "peers": dict(stats.peers),
            "groups": stats.to_dict(),
            "totals": vars(self.totals).copy(),
            "last_round_at": self.live.last_round_at,
            "eval": self.live.last_eval,
            "entropy": last.get("entropy_mean") if last else None,
            "signal_frac": last.get("signal_frac") if last else None,
        }


# Learning-health keys kept in the live history (status, dashboard)
HISTORY_EXTRA = ("entropy_mean", "signal_frac", "local_signal_frac", "eval_accuracy")


class PhaseTimer:
    """`with timer("generate"):` records seconds per phase and shows the phase to the status server."""

    def __init__(self, live: LiveState):
        self.t0 = time.time()
        self.seconds: dict[str, float] = {}
        self.live = live

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                timer.live.phase = phase
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.perf_counter() - self.start
                timer.live.phase = "idle"

        return _Phase()


def _count_sources(groups: list[Group]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g in groups:
        counts[g.source[:16]] = counts.get(g.source[:16], 0) + 1
    return counts


def _mean_abs_adv(groups: list[Group]) -> float:
    from node.learn.grpo import group_advantages

    values = []
    for g in groups:
        values.extend(abs(a) for a in group_advantages(torch.tensor(g.rewards, dtype=torch.float64)).tolist())
    return sum(values) / len(values) if values else 0.0


def _py_rng_state(rng: random.Random) -> list:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _to_py_rng(value: list) -> tuple:
    return (value[0], tuple(value[1]), value[2])
