"""What of a node outlives a round or a process: the loop state a round depends on (captured, to rewind an
abandoned round), checkpoints of it with the weights and optimizer, the identity of those weights (the base
model they belong to, LoRA or full), resume and --lora-init, and the reputation file.

`SapoNode` (node/loop.py) holds the algorithm and asks this class to capture, rewind, save and restore; it
never touches a file itself. The loop state is everything besides weights and optimizer that the next
round depends on: the task sampler, the Python and torch random streams, the I/J policy and the totals.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node import __version__
from node.learn.guard import CollapseGuard
from node.learn.lora import Adapter, base_fingerprint
from node.learn.tasks import TaskSampler
from node.learn.trainer import Trainer
from node.ops.checkpoint import RESTORE_POINT_DIR, CheckpointError, CheckpointStore, load_from
from node.ops.config import NodeConfig
from node.ops.metrics import MetricsWriter
from node.records import NodeTotals
from node.swarm.ij_controller import IJController
from node.swarm.reputation import REPUTATION_FILE, Reputation

log = logging.getLogger("sapo.node")


def weights_base(model: torch.nn.Module, adapter: Adapter | None) -> str:
    """The fingerprint of the weights a checkpoint belongs to: taken before any training or cast (an
    adapter's base never changes)."""
    return adapter.base.fingerprint if adapter is not None else base_fingerprint(model)


@dataclass(eq=False, repr=False)
class Persistence:
    """One node's state on disk and in memory. Holds the node's stateful parts (the same objects the node
    uses) and restores them in place."""

    cfg: NodeConfig
    model: torch.nn.Module
    adapter: Adapter | None
    base_id: str  # `weights_base` of the model as loaded
    trainer: Trainer  # its optimizer and its Python RNG
    sampler: TaskSampler
    select_rng: random.Random
    ij: IJController
    totals: NodeTotals
    metrics: MetricsWriter  # metrics.jsonl, cut back to the checkpoint on resume
    reputation: Reputation
    device: torch.device
    guard: CollapseGuard  # its restore point and rate scale outlive restarts

    def __post_init__(self) -> None:
        self.store = CheckpointStore(self.cfg.run_path, keep=self.cfg.keep_checkpoints)
        self.saved_round = -1  # newest round whose checkpoint is on disk (written or resumed from)
        self.restore_points = CheckpointStore(self.cfg.run_path, keep=1, subdir=RESTORE_POINT_DIR)

    # --- the loop state, in memory ------------------------------------------------------------------------

    def capture(self, next_round: int) -> dict[str, Any]:
        """Everything besides weights and optimizer that the next round depends on (JSON-safe)."""
        state = {
            "next_round": next_round,
            "sampler": self.sampler.state_dict(),
            "select_rng": _py_rng_state(self.select_rng),
            "trainer_rng": _py_rng_state(self.trainer.rng),
            "torch_rng": torch.random.get_rng_state().tolist(),
            "ij_policy": self.ij.state_dict(),
            "totals": self.totals.state_dict(),
            "guard": self.guard.state_dict(),
            "config": self.cfg.to_dict(),
            "version": __version__,
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        return state

    def rewind(self, s: dict[str, Any]) -> int:
        """The inverse of capture(), on resume and to undo an abandoned round; returns the next round."""
        self.sampler.load_state_dict(s["sampler"])
        self.select_rng.setstate(_to_py_rng(s["select_rng"]))
        self.trainer.rng.setstate(_to_py_rng(s["trainer_rng"]))
        torch.random.set_rng_state(torch.tensor(s["torch_rng"], dtype=torch.uint8))
        if "cuda_rng" in s and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(x, dtype=torch.uint8) for x in s["cuda_rng"]])
        self.ij.load_state_dict(s["ij_policy"])
        self.totals.load_state_dict(s["totals"])
        self.guard.load_state_dict(s.get("guard"))  # checkpoints from before the guard: a fresh one
        self.set_lr_scale(self.guard.state.lr_scale)
        return int(s["next_round"])

    # --- on disk ------------------------------------------------------------------------------------------

    def save(self, next_round: int) -> None:
        """Checkpoint the last completed round (next_round - 1), then the reputation file."""
        t0 = time.time()
        path = self.store.save(
            next_round - 1,
            self._weights(),
            self.trainer.optimizer.state_dict(),
            self.capture(next_round),
            self.identity(),
        )
        self.save_reputation()
        self.saved_round = next_round - 1
        log.info("checkpoint %s written in %.1fs", path.name, time.time() - t0)

    def _weights(self) -> dict[str, Any]:
        return self.adapter.state_dict() if self.adapter is not None else self.model.state_dict()

    def _load_weights(self, weights: dict[str, Any]) -> None:
        if self.adapter is not None:
            self.adapter.load_state_dict(weights)
        else:
            self.model.load_state_dict(weights)

    def set_lr_scale(self, scale: float) -> None:
        """The learning rate: the configured one times the collapse guard's scale."""
        self.trainer.set_lr(self.cfg.lr * scale)

    def save_restore_point(self, r: int) -> None:
        """The collapse guard's restore point: weights and optimizer after round r (its best evaluation so far),
        in RUN_DIR/restore-point/ (one kept; written atomically like a checkpoint)."""
        self.restore_points.save(r, self._weights(), self.trainer.optimizer.state_dict(), {"round": r}, self.identity())

    def load_restore_point(self, lr_scale: float, expected_round: int) -> None:
        """Back to the restore point of `expected_round` (the guard's best): its weights and optimizer, at
        `lr_scale` x the configured learning rate. One of another round (left by a timeline the run went back
        from) is refused: CheckpointError, as for none."""
        ckpt = self.restore_points.load_latest(map_location=self.device)
        if ckpt is None:
            raise CheckpointError(f"no restore point in {self.restore_points.dir}")
        if ckpt.round != expected_round:
            raise CheckpointError(f"the restore point is of round {ckpt.round}, not of round {expected_round}")
        self.check_identity(ckpt.meta, f"restore point {ckpt.path}")
        self._load_weights(ckpt.model)
        self.trainer.optimizer.load_state_dict(ckpt.optimizer)
        self.set_lr_scale(lr_scale)

    def restore(self) -> int | None:
        """At start: the newest checkpoint with --resume, else the adapter of --lora-init. Returns the next
        round when weights were loaded (the rollout engine must sync them), None when they are the fresh ones."""
        if self.cfg.resume:
            next_round = self.resume()
            if next_round is not None:
                return next_round
        if self.cfg.lora_init:
            self.load_adapter(self.cfg.lora_init)
            return 0
        return None

    def resume(self) -> int | None:
        """Loads the newest good checkpoint and returns the next round; None when there is none yet."""
        ckpt = self.store.load_latest(map_location=self.device)
        if ckpt is None:
            moved = self.metrics.truncate_after(-1)  # rounds of an earlier start that never checkpointed
            log.warning(
                "--resume: no checkpoint in %s yet; starting at round 0%s",
                self.store.dir,
                f" ({moved} metrics line{'s' * (moved != 1)} moved to metrics.orphaned.jsonl)" if moved else "",
            )
            return None
        self.check_identity(ckpt.meta, f"checkpoint {ckpt.path}")
        if ckpt.optimizer is None:
            raise CheckpointError(
                f"checkpoint {ckpt.path} holds weights only (an export for --lora-init): a run "
                "resumes from its own checkpoints"
            )
        self._load_weights(ckpt.model)
        self.trainer.optimizer.load_state_dict(ckpt.optimizer)
        next_round = self.rewind(ckpt.state)
        self.saved_round = ckpt.round
        self._say_practise_changed(ckpt.state.get("config", {}).get("practise", ""))
        moved = self.metrics.truncate_after(next_round - 1)
        log.info(
            "resumed from %s: next round %d%s",
            ckpt.path.name,
            next_round,
            f" ({moved} metrics line{'s' * (moved != 1)} after it or unreadable moved to metrics.orphaned.jsonl)"
            if moved
            else "",
        )
        return next_round

    def _say_practise_changed(self, then: str) -> None:
        """A resume may practise another part of the mix (a specialist turned generalist, say): like any setting
        but the weights' identity it is allowed, and said, since the task stream then differs from the run's
        so far (the sampler's state goes on; checkpoints from before the option practised the whole mix)."""
        if then != self.cfg.practise:
            log.warning(
                "--practise changed since the checkpoint: %s -> %s; own tasks are sampled from the new part from "
                "here on (peers' groups are still taken from the whole mix)",
                repr(then) if then else "the whole mix",
                repr(self.cfg.practise) if self.cfg.practise else "the whole mix",
            )

    def load_adapter(self, path: str) -> None:
        """--lora-init: adapter weights from another run's checkpoint (not its optimizer or round)."""
        if self.adapter is None:  # the config refuses --lora-init without --lora-rank
            raise CheckpointError("--lora-init needs a LoRA adapter (--lora-rank >= 1)")
        ckpt = load_from(Path(path), map_location=self.device)
        self.check_identity(ckpt.meta, f"--lora-init {ckpt.path}")
        self.adapter.load_state_dict(ckpt.model)
        log.info("adapter initialised from %s (round %d)", ckpt.path, ckpt.round)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint's weights belong to (its manifest's meta): the base model, and the LoRA
        settings when they are an adapter."""
        lora = self.adapter.settings.to_dict() if self.adapter is not None else None
        return {"model": self.cfg.model, "base": self.base_id, "lora": lora}

    def check_identity(self, meta: dict[str, Any] | None, where: str) -> None:
        """Refuse weights that belong to another base model or another kind (full / LoRA rank, alpha)."""
        ours = self.identity()
        theirs = meta or {"lora": None}  # checkpoints from before the manifest said: whole models

        def kind(lora: dict | None) -> str:
            return f"a LoRA adapter (rank {lora['rank']}, alpha {lora['alpha']})" if lora else "a full model"

        if theirs.get("lora") != ours["lora"]:
            raise CheckpointError(f"{where} holds {kind(theirs.get('lora'))}, this node trains {kind(ours['lora'])}")
        if "base" in theirs and theirs["base"] != ours["base"]:
            raise CheckpointError(
                f"{where} was trained on another base model ({theirs.get('model')!r}, fingerprint "
                f"{theirs['base']}); this node loaded {ours['model']!r} (fingerprint {ours['base']})"
            )

    # --- the reputation file ------------------------------------------------------------------------------

    @property
    def reputation_path(self) -> Path:
        return self.cfg.run_path / REPUTATION_FILE

    def load_reputation(self) -> None:
        """Scores and bans outlive restarts (a banned publisher stays banned); --reset-reputation forgets them."""
        if not self.cfg.reset_reputation:
            self.reputation.load(self.reputation_path)

    def save_reputation(self) -> None:
        self.reputation.save(self.reputation_path)


def _py_rng_state(rng: random.Random) -> list:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _to_py_rng(value: list) -> tuple:
    return (value[0], tuple(value[1]), value[2])
