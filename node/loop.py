"""The SAPO round loop. Each round, on this node, independently of every other node:

    1. sample I tasks                       6. verify them: re-generate each task, re-score each completion
    2. generate G completions per task      7. select: drop zero-advantage groups, keep I local + J external
    3. score them with our own reward       8. one GRPO update (pi_old fixed before the first step)
    4. publish the groups to the swarm      9. held-out eval (every --eval-every) and the collapse guard
    5. fetch others' recent batches        10. adapt I/J, record; a checkpoint every --checkpoint-every rounds

`SapoNode` holds only the algorithm: node/build.py makes its parts from a `NodeConfig`, node/records.py
turns a finished round into its record, log line and status, node/evaluation.py runs the held-out
evaluations and the guard's restores, node/persistence.py keeps its state on disk.

Model work runs in a single worker thread; the event loop only awaits it, so swarm I/O, the status
server and signal handling stay responsive. Steps 4-6 run behind the others (node/swarm/pipeline.py): the
round's fetch and verification begin at its start and run while it generates, its publish is handed to a
background task, and select takes the groups verified by then (waiting only at the staleness bound,
--net-max-age rounds); `--net-pipeline off` awaits them in line.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from node.evaluation import NodeEvaluation
from node.learn import precision
from node.learn.engines import RolloutEngine, engine_label
from node.learn.evaluate import EvalResult, HeldOutEval
from node.learn.groups import Group, Prompter, external_token_cap, local_group, select_groups, to_sequences
from node.learn.guard import CollapseGuard
from node.learn.lora import Adapter
from node.learn.sampling import SamplingConfig
from node.learn.stop import RoundAbandoned, StopRequest
from node.learn.tasks import TaskMix, TaskSampler
from node.learn.trainer import StepStats, Trainer
from node.ops.config import NodeConfig
from node.ops.live import LiveState, PhaseTimer
from node.ops.metrics import MetricsWriter, peak_memory_mb
from node.ops.tensorboard import TensorBoardLog
from node.persistence import Persistence
from node.records import (
    NodeTotals,
    QuietRounds,
    log_line,
    network_record,
    remember_round,
    round_context,
    round_record,
    status_snapshot,
    tokens_generated,
)
from node.swarm.exchange import Exchange
from node.swarm.ij_controller import IJController, RoundObservation
from node.swarm.pipeline import NetPipeline

log = logging.getLogger("sapo.node")


@dataclass
class RoundResult:
    round: int
    record: dict[str, Any]


@dataclass(eq=False, repr=False)
class SapoNode:
    """One peer's rounds. Built by node/build.py (`build_node`); with --lora-rank `model` is wrapped by
    `adapter`, this peer's LoRA adapter, possibly on a base shared with other peers (node/learn/lora.py)."""

    cfg: NodeConfig
    mix: TaskMix
    model: torch.nn.Module  # the policy being trained
    tokenizer: Any
    device: torch.device
    adapter: Adapter | None
    precision: str  # "bf16" or "off": every job of the model thread runs under it (node/learn/precision.py)
    engine: RolloutEngine  # samples the completions (torch, llama.cpp or vLLM)
    sampling: SamplingConfig
    prompter: Prompter
    sampler: TaskSampler  # seeded: the same tasks again on resume
    select_rng: random.Random  # which external groups are trained on
    trainer: Trainer
    ij: IJController  # this round's split I/J, adapted to what each round brought
    exchange: Exchange  # the swarm (or Silo)
    net: NetPipeline  # publish, fetch and verify behind the round (or in line)
    held_out: HeldOutEval
    totals: NodeTotals
    metrics: MetricsWriter
    tensorboard: TensorBoardLog
    persistence: Persistence  # checkpoints, resume, the state an abandoned round rewinds to
    guard: CollapseGuard  # after each evaluation: keep, new restore point, or restore (node/learn/guard.py)
    stop: StopRequest

    def __post_init__(self) -> None:
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.live = LiveState()
        self.next_round = 0
        self.rounds_this_run = 0
        self.engine_stale = False  # the weights moved since the engine last synced (an update, a resume)
        self._stop_event: asyncio.Event | None = None  # wakes network waits; made in run()
        self.publisher = ""  # this node's public key, once the exchange has started
        self.mid_round_weights = False  # a round failed after its weights moved: memory is no round's state
        self.start_due = False  # open() sets it: step() evaluates the starting weights before round 0
        self.quiet = QuietRounds()  # says so when round after round brings no update
        parts = (self.held_out, self.guard, self.persistence, self.metrics, self.trainer, self.live)
        self.evaluation = NodeEvaluation(*parts, held_out_run=self._held_out, in_worker=self._in_worker)

    @property
    def stop_requested(self) -> bool:
        return self.stop.is_set()

    @property
    def pending(self) -> bool:
        return self.next_round < self.cfg.rounds

    async def run(self) -> int:
        """Runs rounds until cfg.rounds (in total) or a stop request; returns the rounds completed now."""
        self._stop_event = asyncio.Event()
        self.stop.on_set(_from_any_thread(asyncio.get_running_loop(), self._stop_event.set))  # wakes network waits
        self.net.start(self._stop_event)
        await self.open()
        try:
            while self.pending and not self.stop_requested:
                await self.step()
        except RoundAbandoned:
            log.warning(
                "round %d abandoned at a safe point (%s); it is redone on resume",
                self.next_round,
                self.stop.reason or "stop requested",
            )
        finally:
            await self.close()
        return self.rounds_this_run

    async def open(self) -> None:
        await self._in_worker(self.persistence.load_reputation)
        await self.exchange.start()
        self.publisher = self.exchange.identity_info().get("public_key", "")  # who the others see (records)
        restored = await self._in_worker(self.persistence.restore)  # --resume, else --lora-init
        if restored is not None:
            self.next_round, self.engine_stale = restored, True
            await self.evaluation.skipped_round(self.next_round)  # a due evaluation a stop skipped
        # the starting weights' evaluation, the collapse guard's first reference: before round 0 of a fresh start
        self.start_due = self.evaluation.start_due(self.next_round)
        # after resume's truncation: the curves hold each round of metrics.jsonl once, new rounds follow
        await self._in_worker(self.tensorboard.rebuild, self.metrics.path)

    async def step(self) -> dict:
        """One round, then a checkpoint every --checkpoint-every rounds. An abandoned round leaves no trace:
        the state it changed (task sampler, RNG streams) is put back before RoundAbandoned goes on. A round
        that fails on an error is put back the same way while its weights have not moved; once they have, no
        round's state is in memory, and close() saves none."""
        if self.start_due:  # nothing has changed yet: an error here needs no rewind
            self.start_due = False
            self.engine_stale |= await self.evaluation.start()
        at_start = self.persistence.capture(self.next_round)
        weights_before = self.evaluation.weights()
        try:
            result = await self.run_round(self.next_round)
        except RoundAbandoned:  # rewound after the worker has let go of the round
            self.next_round = await self._in_worker(self.persistence.rewind, at_start)
            raise
        except Exception:  # a bug, a failing disk, out of memory
            if self.evaluation.weights() != weights_before:
                self.mid_round_weights = True  # the weights cannot be rewound
            else:
                self.next_round = await self._in_worker(self.persistence.rewind, at_start)
            raise
        self.next_round = result.round + 1
        self.rounds_this_run += 1
        if self.next_round % self.cfg.checkpoint_every == 0 and self.pending:
            await self._checkpoint()
        return result.record

    async def run_round(self, r: int) -> RoundResult:
        """One SAPO round, the module docstring's steps in order; the network's (4-6) behind the others."""
        timer = PhaseTimer(self.live)
        num_local, num_external = self.ij.split()
        self.live.round = r
        self.net.prefetch(r)  # 5-6 begin: others' batches fetched and verified while we generate (in line: later)

        with timer("sample"):
            tasks = self.sampler.sample(num_local)
        if self.engine_stale:
            with timer("sync"):
                await self._in_worker(self.engine.sync, self.model)
            self.engine_stale = False
        with timer("generate"):
            prompts = [self.prompter(t) for t in tasks]
            sampled = await self._in_worker(self.engine.sample, prompts, self.cfg.generations, self.sampling, self.stop)
        with timer("score"):
            local = await self._in_worker(
                lambda: [local_group(t, s, self.mix.answer_prefix) for t, s in zip(tasks, sampled)]
            )
        with timer("publish"):
            await self.net.publish(r, local)  # to the background publisher (in line: published now)
        arrival = await self.net.take(r, timer)  # the groups verified by now (in line: fetched and verified now)
        external = arrival.groups
        with timer("select"):
            selection = select_groups(local, self.totals.fresh(external), num_local, num_external, self.select_rng)
        with timer("train"):
            stats = await self._in_worker(self.train, selection.local + selection.external)
        self.engine_stale = self.engine_stale or stats.optimizer_steps > 0
        self.quiet.saw(r, stats.optimizer_steps)

        tokens = tokens_generated(sampled)
        self.totals.add(selection, tokens, stats.screen)
        record = round_record(r, timer, local, external, selection, (num_local, num_external), stats, tokens)
        memory = peak_memory_mb(self.device)
        record |= round_context(arrival.counts, self.exchange.stats, memory, self.cfg, self.publisher)
        record |= network_record(r, arrival, selection.external, self.net)
        record["rollout_engine"] = engine_label(self.engine)
        if await self.evaluation.after_round(r, timer, record, self.stop_requested):
            self.engine_stale = True  # the collapse guard put other weights back
        self.ij.update(RoundObservation.of(r, local, selection))
        self._keep(record)
        return RoundResult(r, record)

    def train(self, groups: list[Group]) -> StepStats:
        cap = external_token_cap(self.sampling.max_new_tokens)
        seqs = to_sequences(
            groups, self.tokenizer, self.prompter, self.cfg.scale_std, self.cfg.external_loss, cap, self.trainer.screen
        )
        return self.trainer.step(seqs)

    def _keep(self, record: dict) -> None:
        """The finished round into metrics.jsonl, TensorBoard, the live history and node.log."""
        self.metrics.write(record)
        self.worker.submit(self.tensorboard.write, dict(record))  # model thread, before the next round's work
        remember_round(self.live, record)
        log.info("%s", log_line(record))

    async def _held_out(self, unseen: bool) -> EvalResult:
        """The held-out evaluation of the weights as they are, in the model thread (RoundAbandoned on a stop);
        an engine that decodes it is synced to them first (then the next round needs no sync); `unseen`: the
        unseen set too."""
        if self.held_out.engine is not None and self.engine_stale:
            await self._in_worker(self.engine.sync, self.model)
            self.engine_stale = False
        return await self._in_worker(
            self.held_out.run,
            self.model,
            self.tokenizer,
            self.prompter,
            self.sampling.max_new_tokens,
            self.stop,
            unseen,
        )

    async def _checkpoint(self) -> None:
        self.live.phase = "checkpoint"
        await self._in_worker(self.persistence.save, self.next_round)

    async def close(self) -> None:
        """Checkpoint the last completed round unless the disk has it, then release the swarm and the worker."""
        try:
            if not self.mid_round_weights and self.next_round - 1 > self.persistence.saved_round:
                await self._checkpoint()  # the reputation file with it
            else:
                if self.mid_round_weights:
                    _log_weights_not_saved(self.next_round, self.persistence.saved_round)
                await self._in_worker(self.persistence.save_reputation)
        finally:
            await self.net.close()  # the background publish and prefetch: cancelled, nothing waits for them
            await self.exchange.close()
            self.worker.shutdown(wait=True)  # after the last queued TensorBoard write
            self.tensorboard.close()
            self.engine.close()
            self.live.phase = "stopped"

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe status for /status, /metrics and the dashboard."""
        return status_snapshot(self.cfg, self.live, self.exchange, self.totals, self.net.state())

    # --- the model thread and the network -----------------------------------------------------------------

    async def _in_worker(self, fn: Callable, *args):
        def run():
            if self.adapter is not None:  # peers sharing one base take turns: all model work through ours
                self.adapter.activate()
            with precision.autocast(self.precision, self.device):
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self.worker, run)


def _from_any_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> Callable[[], None]:
    """`fn` run on `loop` from any thread; nothing if the loop is already gone (a late console loss)."""

    def call() -> None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass

    return call


def _log_weights_not_saved(next_round: int, saved: int) -> None:
    log.error(
        "round %d failed after its weights moved: not checkpointing them (resumed, they would count that round "
        "twice); --resume continues from %s",
        next_round,
        f"the checkpoint of round {saved}" if saved >= 0 else "round 0 (no checkpoint yet)",
    )
