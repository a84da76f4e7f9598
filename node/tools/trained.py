"""A trained model as a node left it: one checkpoint of a run dir (the newest, or a round named), the settings
it ran with, the records that say how good it was, and its weights put back on their base model exactly as
the node held them (LoRA adapter on its base, or the whole model).

Read only: nothing in the run dir is written, moved or recovered (a running node may own it). Every problem a
user can cause (no checkpoint, a round that is not there, a corrupt file, weights of another base) is a
`ToolError`: one line, which the tools print and exit 2 on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from node.learn import precision
from node.learn.guard import START_ROUND
from node.learn.lora import Adapter, attach, base_fingerprint
from node.learn.model_io import ModelLoadError, load_model
from node.learn.tasks import TaskError, TaskMix, resolve_mix
from node.ops.checkpoint import CHECKPOINTS_DIR, Checkpoint, CheckpointError, CheckpointStore, round_of
from node.ops.config import NodeConfig
from node.ops.metrics import METRICS_FILE

RUN_JSON = "run.json"  # sapo-experiment's provenance (commit, versions), in the experiment's dir above a peer's


class ToolError(RuntimeError):
    """One clear line for the user; the command exits 2 and writes nothing."""


@dataclass
class TrainedRun:
    """One checkpoint of a run, with the run's settings and records."""

    checkpoint: Checkpoint
    cfg: NodeConfig
    run_dir: Path | None  # the dir with checkpoints/ and metrics.jsonl (None: a checkpoint copied on its own)

    @property
    def round(self) -> int:
        return self.checkpoint.round

    @property
    def lora(self) -> dict[str, Any] | None:
        return (self.checkpoint.meta or {}).get("lora")

    def mix(self) -> TaskMix:
        try:
            return resolve_mix(self.cfg.tasks)
        except TaskError as exc:
            raise ToolError(f"the run's task mix {self.cfg.tasks!r} does not resolve here: {exc}") from None

    def last_eval(self) -> dict[str, Any] | None:
        """The node's own held-out figures of the checkpoint's weights (eval_* keys, `round`: after which round;
        -1: the starting weights), or of the last weights it evaluated before them; None if none. A collapse
        guard's restore put older weights back: their evaluation is the one that holds after it."""
        path = self.run_dir / METRICS_FILE if self.run_dir is not None else None
        if path is None or not path.is_file():
            return None
        evals: dict[int, dict[str, Any]] = {}
        current: dict[str, Any] | None = None
        for row in _rows(path):
            r = row.get("round")
            if not isinstance(r, int) or r > self.round:
                continue
            if "start_accuracy" in row:
                current = evals[START_ROUND] = _renamed(row, "start_", START_ROUND)
            if "eval_accuracy" in row:
                current = evals[r] = _renamed(row, "eval_", r)
            back = row.get("guard_restored_to")
            if row.get("guard_action") == "restore" and isinstance(back, int):
                current = evals.get(back, current)
        return current

    def provenance(self) -> dict[str, Any]:
        """run.json of the experiment the run belongs to (the run dir or up to three levels above), if any."""
        start = self.run_dir or self.checkpoint.path
        for d in [start, *list(start.parents)[:3]]:
            f = d / RUN_JSON
            if f.is_file():
                try:
                    data = json.loads(f.read_text())
                except (OSError, ValueError):
                    return {}
                return data if isinstance(data, dict) else {}
        return {}


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill: the node's own reader skips it too
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _renamed(row: dict[str, Any], prefix: str, round_: int) -> dict[str, Any]:
    """An evaluation's keys under eval_ (the starting weights' start_ keys too), with the round it followed."""
    out = {"eval_" + k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}
    return {**out, "round": round_}


def checkpoint_dirs(run_dir: Path) -> dict[int, Path]:
    """round -> checkpoint directory of a run dir (complete or not: loading verifies)."""
    store = run_dir / CHECKPOINTS_DIR
    if not store.is_dir():
        return {}
    found = {round_of(p): p for p in store.glob("round-*") if p.is_dir()}
    return {r: p for r, p in found.items() if r is not None and r >= 0}


def open_run(path: Path, round_: int | None = None) -> TrainedRun:
    """A run dir's newest checkpoint (or that of `round_`), or a checkpoint directory named directly."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ToolError(f"{path}: no such run dir or checkpoint")
    if (path / "MANIFEST.json").is_file():  # a round-* directory itself
        if round_ is not None:
            raise ToolError(f"{path} is one checkpoint already: --round chooses among a run dir's checkpoints")
        run_dir = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else None
        rounds = checkpoint_dirs(run_dir) if run_dir is not None else {}
        chosen, ckpt_path = round_of(path), path
    else:
        run_dir, rounds = path, checkpoint_dirs(path)
        if not rounds:
            raise ToolError(f"{path}: no checkpoint (checkpoints/round-*) in this run dir: nothing to take out yet")
        if round_ is not None and round_ not in rounds:
            raise ToolError(f"{path}: no checkpoint of round {round_} (it has {_listed(sorted(rounds))})")
        chosen = round_ if round_ is not None else max(rounds)
        ckpt_path = rounds[chosen]
    try:
        ckpt = CheckpointStore.load(ckpt_path)
    except CheckpointError as exc:
        older = sorted(r for r in rounds if chosen is not None and r < chosen)
        hint = f"; --round {older[-1]} takes an older one" if older else ""
        raise ToolError(f"corrupt checkpoint: {exc}{hint}") from None
    return TrainedRun(ckpt, _config_of(ckpt), run_dir)


def _listed(rounds: list[int]) -> str:
    shown = ", ".join(map(str, rounds[-8:]))
    return f"round{'s' * (len(rounds) != 1)} {'..., ' if len(rounds) > 8 else ''}{shown}"


def _config_of(ckpt: Checkpoint) -> NodeConfig:
    """The node's settings as the checkpoint recorded them; options this version does not know are left out."""
    raw = ckpt.state.get("config")
    if not isinstance(raw, dict):
        raise ToolError(f"{ckpt.path}: state.json records no node settings")
    known = {f.name for f in fields(NodeConfig)}
    try:
        return NodeConfig(**{k: v for k, v in raw.items() if k in known})
    except TypeError as exc:
        raise ToolError(f"{ckpt.path}: the recorded settings do not fit this version's: {exc}") from None


@dataclass
class Policy:
    """A trained model in memory, as the node held it: `model` is the PEFT wrapper when `adapter` is set."""

    model: torch.nn.Module
    tokenizer: Any
    adapter: Adapter | None
    mix: TaskMix
    precision: str  # the node's mixed precision on this device ("bf16" or "off")


def load_trained(run: TrainedRun, device: torch.device, node_precision: bool = False) -> Policy:
    """The checkpoint's weights on their base model (loaded as the node loads it, fingerprint checked).
    `node_precision`: also the node's storage of a LoRA base under mixed precision (bf16 frozen weights), so
    that answers match the node's own evaluation; otherwise every weight stays float32 (exact, for export)."""
    cfg, ckpt = run.cfg, run.checkpoint
    try:
        model, tokenizer = load_model(cfg.model, device)
    except ModelLoadError as exc:
        raise ToolError(f"the run's base model does not load: {exc}") from None
    meta = ckpt.meta or {}
    if "base" in meta and base_fingerprint(model) != meta["base"]:
        raise ToolError(
            f"{ckpt.path} was trained on another base model than {cfg.model!r} loads here "
            f"(fingerprint {meta['base']}, here {base_fingerprint(model)})"
        )
    lora = run.lora
    adapter = None
    try:
        if lora:
            adapter = attach(model, int(lora["rank"]), float(lora["alpha"]), seed=cfg.seed)
            adapter.load_state_dict(ckpt.model)
            model = adapter.model
        else:
            model.load_state_dict(ckpt.model)
    except (ValueError, RuntimeError, KeyError) as exc:
        raise ToolError(f"{ckpt.path}: the weights do not fit {cfg.model!r}: {exc}") from None
    mode = precision.resolve(cfg.mixed_precision, device) if node_precision else "off"
    if adapter is not None and mode == "bf16":
        adapter.base.store_frozen_weights_as(torch.bfloat16)
    model.eval()
    return Policy(model, tokenizer, adapter, run.mix(), mode)
