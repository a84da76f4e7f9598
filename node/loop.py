"""The SAPO round loop. Each round, on this node, independently of every other node:

    1. sample I tasks                       5. collect verified external groups (window of recent rounds)
    2. generate G completions per task      6. select: drop zero-advantage groups, keep I local + J external
    3. score them with our own reward       7. one GRPO update (pi_old fixed before the first step)
    4. publish the groups to the swarm      8. metrics, adapt I/J, checkpoint (every --eval-every: held-out eval)

Model work runs in a single worker thread; the event loop only awaits it, so swarm I/O, the status
server and signal handling stay responsive.

Stopping: a `StopRequest` is polled at safe points (between generated tokens, between micro-batches,
before the first optimizer step; network phases race against it). The round in progress is abandoned
(`RoundAbandoned`), the node's state is put back to where that round started, the last completed round
is checkpointed if the disk does not have it yet, and the node exits: the abandoned round is redone on
resume exactly as if it had never started.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from node import __version__
from node.ops.checkpoint import CheckpointError, CheckpointStore, load_from
from node.ops.config import NodeConfig
from node.ops.live import LiveState, PhaseTimer
from node.swarm.exchange import Exchange
from node.swarm.reputation import REPUTATION_FILE
from node.learn import precision
from node.learn.evaluate import HeldOutEval
from node.learn.lora import Adapter, attach, base_fingerprint
from node.learn.groups import Group, Prompter, collapse_metrics, local_group, select_groups, to_sequences
from node.swarm.ij_policy import make_ij_policy
from node.ops.metrics import MetricsWriter
from node.ops.tensorboard import TensorBoardLog
from node.learn.engines import make_engine
from node.learn.policy import SamplingConfig
from node.learn.stop import RoundAbandoned, StopRequest
from node.learn.tasks import TaskMix, TaskSampler
from node.learn.trainer import StepStats, TrainConfig, Trainer
from node.records import NodeTotals, RoundRecords

log = logging.getLogger("sapo.node")


@dataclass
class RoundResult:
    round: int
    record: dict[str, Any]


class SapoNode(RoundRecords):
    """With --lora-rank the node trains a LoRA adapter on `model` (wrapped here), or on the shared base of
    `adapter` when several peers in one process share one base model (node/learn/lora.py)."""

    def __init__(self, cfg: NodeConfig, mix: TaskMix, model: torch.nn.Module, tokenizer, exchange: Exchange,
                 device: torch.device, stop: StopRequest | None = None, adapter: Adapter | None = None):
        self.cfg = cfg
        self.mix = mix
        if adapter is None and cfg.lora_rank > 0:
            adapter = attach(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
        self.adapter = adapter
        self.model = model = adapter.model if adapter is not None else model
        # the weights a checkpoint belongs to: taken before any training (an adapter's base never changes)
        self.base_id = adapter.base.fingerprint if adapter is not None else base_fingerprint(model)
        self.tokenizer = tokenizer
        self.exchange = exchange
        self.device = device
        self.run_dir = cfg.run_path
        self.stop = stop or StopRequest()
        self.sampling = SamplingConfig(cfg.temperature, cfg.top_p, cfg.max_new_tokens or mix.max_new_tokens)
        self.trainer = Trainer(model, tokenizer.pad_token_id, TrainConfig(
            lr=cfg.lr, eps_low=cfg.eps_low, eps_high=cfg.eps_high, beta=cfg.beta, loss_type=cfg.loss_type,
            scale_std=cfg.scale_std, max_grad_norm=cfg.max_grad_norm, epochs=cfg.epochs,
            minibatches=cfg.minibatches, micro_batch_size=cfg.micro_batch_size, temperature=cfg.temperature,
            max_completion_len=self.sampling.max_new_tokens, prefix_sharing=cfg.prefix_sharing), seed=cfg.seed,
            stop=self.stop, adapter=adapter)
        # every forward pass (sampling, update, evaluation) runs in the model thread under this precision
        self.precision = precision.resolve(cfg.mixed_precision, device)
        if adapter is not None and self.precision == "bf16":
            adapter.base.store_frozen_weights_as(torch.bfloat16)  # cast once, not in every forward
        self.engine = make_engine(cfg.rollout_engine, model, tokenizer, cfg.model, weight_type=cfg.engine_weights,
                                  logp_exact=self.precision == "off")
        self.engine_stale = False  # the weights moved since the engine last synced (an update, a resume)
        self.prompter = Prompter(tokenizer, mix)
        self.sampler = TaskSampler(mix, cfg.seed)
        self.select_rng = random.Random(cfg.seed + 1)
        total = cfg.num_local + cfg.num_external
        self.ij = make_ij_policy(cfg.ij_policy, total=total, initial_j=cfg.num_external)
        self.store = CheckpointStore(self.run_dir, keep=cfg.keep_checkpoints)
        self.metrics = MetricsWriter(self.run_dir)
        self.tensorboard = TensorBoardLog(self.run_dir, enabled=cfg.tensorboard)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.next_round = 0
        self.rounds_this_run = 0
        self.totals = NodeTotals()
        self.live = LiveState()
        self.saved_round = -1  # newest round whose checkpoint is on disk (written or resumed from)
        self._stop_event: asyncio.Event | None = None  # wakes network waits; made in run()
        self.held_out = HeldOutEval(mix, cfg.eval_size, cfg.eval_every, cfg.rounds)
        torch.manual_seed(cfg.seed)

    # --- the algorithm ----------------------------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        return self.stop.is_set()

    async def run(self) -> int:
        """Runs rounds until cfg.rounds (in total) or a stop request; returns the rounds completed now."""
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        def wake_network_waits() -> None:  # any thread; the loop may already be gone (late console loss)
            try:
                loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:
                pass

        self.stop.on_set(wake_network_waits)
        await self.open()
        try:
            while self.pending and not self.stop_requested:
                await self.step()
        except RoundAbandoned:
            log.warning("round %d abandoned at a safe point (%s); it is redone on resume", self.next_round,
                        self.stop.reason or "stop requested")
        finally:
            await self.close()
        return self.rounds_this_run

    async def open(self) -> None:
        await self._in_worker(self._load_reputation)
        await self.exchange.start()
        resumed = self.cfg.resume and await self._in_worker(self.resume)
        if self.cfg.lora_init and not resumed:
            await self._in_worker(self.load_adapter, self.cfg.lora_init)
        # after resume's truncation: the curves hold each round of metrics.jsonl once, new rounds follow
        await self._in_worker(self.tensorboard.rebuild, self.metrics.path)

    @property
    def pending(self) -> bool:
        return self.next_round < self.cfg.rounds

    async def step(self) -> dict:
        """One round, then a checkpoint every --checkpoint-every rounds. An abandoned round leaves no trace:
        the state it changed (task sampler, RNG streams) is put back before RoundAbandoned goes on."""
        at_start = self.state_dict()
        try:
            result = await self.run_round(self.next_round)
        except RoundAbandoned:
            await self._in_worker(self.load_state, at_start)  # after the worker has let go of the round
            raise
        self.next_round = result.round + 1
        self.rounds_this_run += 1
        if self.next_round % self.cfg.checkpoint_every == 0 and self.pending:
            await self._checkpoint()
        return result.record

    async def close(self) -> None:
        """Checkpoint the last completed round unless the disk has it, then release the swarm and the worker."""
        try:
            if self.next_round - 1 > self.saved_round:
                await self._checkpoint()
            else:
                await self._in_worker(self._save_reputation)
        finally:
            await self.exchange.close()
            self.worker.shutdown(wait=True)  # after the last queued TensorBoard write
            self.tensorboard.close()
            if hasattr(self.engine, "close"):
                self.engine.close()
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
        if self.engine_stale:
            with timer("sync"):
                await self._in_worker(self.engine.sync, self.model)
            self.engine_stale = False
        with timer("generate"):
            prompts = [self.prompter(t) for t in tasks]
            sampled = await self._in_worker(self.engine.sample, prompts, self.cfg.generations, self.sampling,
                                            self.stop)
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
        self.engine_stale = self.engine_stale or stats.optimizer_steps > 0

        record = self._record(r, timer, local, selection, stats, num_local, num_external, sampled)
        record.update(collapse_metrics(local, external))
        if self.held_out.due(r) and not self.stop_requested:
            await self._evaluate(r, timer, record)
        self.ij.update(self._observation(r, selection, record))
        self.metrics.write(record)
        self.worker.submit(self.tensorboard.write, dict(record))  # model thread, before the next round's work
        self._log_round(record)
        return RoundResult(r, record)

    async def _evaluate(self, r: int, timer: PhaseTimer, record: dict) -> None:
        """Held-out accuracy into this round's record. The round is complete by now: a stop during the
        evaluation skips it (the round stays), it never abandons the round."""
        try:
            with timer("eval"):
                result = await self._in_worker(self.held_out.run, self.model, self.tokenizer, self.prompter,
                                               self.sampling.max_new_tokens, self.stop)
        except RoundAbandoned:
            log.info("held-out evaluation of round %d skipped: stop requested", r)
            return
        self.live.last_eval = {"round": r, **{k: v for k, v in result.to_record().items()
                                               if not isinstance(v, list)}}  # per-task lists: metrics only
        record.update(result.to_record(), t_end=time.time(), round_s=round(time.time() - timer.t0, 4))
        record["phase_s"]["eval"] = round(timer.seconds["eval"], 4)
        log.info("held-out accuracy %.3f after round %d (%d tasks, greedy, %.1fs; one constant answer per "
                 "dataset scores %.3f)", result.accuracy, r, result.size, result.seconds, result.baseline or 0.0)

    def train(self, groups: list[Group]) -> StepStats:
        seqs = to_sequences(groups, self.tokenizer, self.prompter, self.cfg.scale_std)
        return self.trainer.step(seqs)

    # --- helpers ------------------------------------------------------------------------------------------

    async def _in_worker(self, fn: Callable, *args):
        def run():
            if self.adapter is not None:  # peers sharing one base take turns: all model work through ours
                self.adapter.activate()
            with precision.autocast(self.precision, self.device):
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self.worker, run)

    async def _bounded(self, coro, what: str):
        """A round never waits on the network longer than --net-timeout, nor after a stop request."""
        task = asyncio.ensure_future(coro)
        stopped = asyncio.ensure_future(self._stop_event.wait()) if self._stop_event else None
        try:
            await asyncio.wait([t for t in (task, stopped) if t], timeout=self.cfg.net_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopped is not None:
                stopped.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(_ignore_outcome)
            self.stop.check()
            log.warning("%s took longer than --net-timeout %.1fs; going on without it", what, self.cfg.net_timeout)
            return None
        try:
            return task.result()
        except Exception as exc:  # the swarm must never crash the node
            log.warning("%s failed: %s", what, exc)
        return None

    # --- checkpoint / resume ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything besides weights and optimizer that the next round depends on (JSON-safe)."""
        state = {
            "next_round": self.next_round,
            "sampler": self.sampler.state_dict(),
            "select_rng": _py_rng_state(self.select_rng),
            "trainer_rng": _py_rng_state(self.trainer.rng),
            "torch_rng": torch.random.get_rng_state().tolist(),
            "ij_policy": self.ij.state_dict(),
            "totals": dict(vars(self.totals)),
            "config": self.cfg.to_dict(),
            "version": __version__,
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        return state

    async def _checkpoint(self) -> None:
        self.live.phase = "checkpoint"
        t0 = time.time()
        weights = self.adapter.state_dict if self.adapter is not None else self.model.state_dict
        path = await self._in_worker(lambda: self.store.save(
            self.next_round - 1, weights(), self.trainer.optimizer.state_dict(), self.state_dict(), self.identity()))
        await self._in_worker(self._save_reputation)
        self.saved_round = self.next_round - 1
        log.info("checkpoint %s written in %.1fs", path.name, time.time() - t0)

    def _load_reputation(self) -> None:
        """Scores and bans outlive restarts (a banned publisher stays banned); --reset-reputation forgets them."""
        if not self.cfg.reset_reputation:
            self.exchange.reputation.load(self.run_dir / REPUTATION_FILE)

    def _save_reputation(self) -> None:
        self.exchange.reputation.save(self.run_dir / REPUTATION_FILE)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint's weights belong to (its manifest's meta): the base model, and the LoRA
        settings when they are an adapter."""
        lora = self.adapter.settings.to_dict() if self.adapter is not None else None
        return {"model": self.cfg.model, "base": self.base_id, "lora": lora}

    def _check_identity(self, meta: dict[str, Any] | None, where: str) -> None:
        """Refuse weights that belong to another base model or another kind (full / LoRA rank, alpha)."""
        ours = self.identity()
        theirs = meta or {"lora": None}  # checkpoints from before the manifest said: whole models

        def kind(lora: dict | None) -> str:
            return f"a LoRA adapter (rank {lora['rank']}, alpha {lora['alpha']})" if lora else "a full model"

        if theirs.get("lora") != ours["lora"]:
            raise CheckpointError(f"{where} holds {kind(theirs.get('lora'))}, this node trains {kind(ours['lora'])}")
        if "base" in theirs and theirs["base"] != ours["base"]:
            raise CheckpointError(f"{where} was trained on another base model ({theirs.get('model')!r}, fingerprint "
                                  f"{theirs['base']}); this node loaded {ours['model']!r} (fingerprint {ours['base']})")

    def load_adapter(self, path: str) -> None:
        """--lora-init: adapter weights from another run's checkpoint (not its optimizer or round)."""
        ckpt = load_from(path, map_location=self.device)
        self._check_identity(ckpt.meta, f"--lora-init {ckpt.path}")
        self.adapter.load_state_dict(ckpt.model)
        self.engine_stale = True
        log.info("adapter initialised from %s (round %d)", ckpt.path, ckpt.round)

    def resume(self) -> bool:
        """Loads the newest good checkpoint; False when there is none yet."""
        ckpt = self.store.load_latest(map_location=self.device)
        if ckpt is None:
            log.warning("--resume: no checkpoint in %s yet; starting at round 0", self.store.dir)
            return False
        self._check_identity(ckpt.meta, f"checkpoint {ckpt.path}")
        if self.adapter is not None:
            self.adapter.load_state_dict(ckpt.model)
        else:
            self.model.load_state_dict(ckpt.model)
        self.trainer.optimizer.load_state_dict(ckpt.optimizer)
        self.engine_stale = True
        self.load_state(ckpt.state)
        self.saved_round = ckpt.round
        moved = self.metrics.truncate_after(self.next_round - 1)
        log.info("resumed from %s: next round %d%s", ckpt.path.name, self.next_round,
                 f" ({moved} metrics lines after it moved to metrics.orphaned.jsonl)" if moved else "")
        return True

    def load_state(self, s: dict[str, Any]) -> None:
        """The inverse of state_dict(): on resume, and to undo an abandoned round."""
        self.next_round = int(s["next_round"])
        self.sampler.load_state_dict(s["sampler"])
        self.select_rng.setstate(_to_py_rng(s["select_rng"]))
        self.trainer.rng.setstate(_to_py_rng(s["trainer_rng"]))
        torch.random.set_rng_state(torch.tensor(s["torch_rng"], dtype=torch.uint8))
        if "cuda_rng" in s and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(x, dtype=torch.uint8) for x in s["cuda_rng"]])
        self.ij.load_state_dict(s["ij_policy"])
        self.totals = NodeTotals(**s["totals"])


def _ignore_outcome(task: asyncio.Future) -> None:
    """A network call given up on (timeout or stop): fetch its outcome so asyncio does not warn about it."""
    if not task.cancelled():
        task.exception()


def _py_rng_state(rng: random.Random) -> list:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _to_py_rng(value: list) -> tuple:
    return (value[0], tuple(value[1]), value[2])
