"""Peers on one machine that start from the same weights evaluate them once (`--eval-share DIR`).

The quick start's five peers load the same model and, before round 0, each evaluate the same starting weights
on the same held-out set: the same greedy answers five times, about 40 CPU-seconds on 2 cores before anyone
trains. With a shared directory the first peer takes a lock file, evaluates and leaves the result; the others
wait for it and read it. The key is a digest of the weights as they act (a fresh LoRA adapter, whose B is
zero, adds nothing, so it is left out) and of everything else the answers depend on (`spec`: model, task mix,
set sizes, answer length, evaluator, precision, threads), so peers whose starts differ never share.

A peer that holds the lock and dies leaves it behind: a waiter takes over once the holder's process is gone.
A waiter never waits longer than `wait_s`, then evaluates itself; a stop request ends the wait at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from node.learn.evaluate import EvalResult
from node.learn.lora import base_name
from node.learn.packaged import write_json
from node.learn.stop import StopRequest

log = logging.getLogger(__name__)


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of what the model computes with: every tensor of its state, except a LoRA adapter whose B
    matrices are all zero (a fresh adapter: the model acts as its base)."""
    state = model.state_dict()
    lora = [k for k in state if "lora_" in k]
    fresh = bool(lora) and all(not state[k].any() for k in lora if "lora_B" in k)
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        if fresh and "lora_" in name:
            continue
        tensor = state[name].detach().cpu().contiguous()
        h.update(f"{base_name(name)}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if tensor.numel():  # the tensor's own bytes, read in place (no copy of the model's 270-540 MB)
            h.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


@dataclasses.dataclass
class EvalShare:
    directory: Path
    spec: str  # everything besides the weights that the answers depend on
    wait_s: float = 900.0
    poll_s: float = 0.5

    def evaluate(
        self, model: torch.nn.Module, compute: Callable[[], EvalResult], stop: StopRequest | None
    ) -> EvalResult:
        """The result for these weights: read, or computed here (and left for the others). In the model
        thread; RoundAbandoned on a stop request, as `compute` does."""
        key = hashlib.blake2b(f"{weights_digest(model)}|{self.spec}".encode(), digest_size=16).hexdigest()
        self.directory.mkdir(parents=True, exist_ok=True)
        result_path, lock = self.directory / f"{key}.json", self.directory / f"{key}.lock"
        deadline = time.monotonic() + self.wait_s
        waited = False
        warned: set[Path] = set()
        while True:
            cached = _read(result_path, warned)
            if cached is not None:
                log.info("held-out evaluation of the starting weights: another peer's result (same weights, same set)")
                return cached
            if _take(lock):
                try:
                    result = compute()
                    write_json(result_path, dataclasses.asdict(result))  # readers never see half
                    return result
                finally:
                    lock.unlink(missing_ok=True)
            if not _holder_alive(lock):
                lock.unlink(missing_ok=True)  # its peer died: the next pass takes it
                continue
            if time.monotonic() > deadline:
                log.info(
                    "held-out evaluation of the starting weights: waited %.0fs for another peer's; own", self.wait_s
                )
                return compute()
            if not waited:
                log.info("held-out evaluation of the starting weights: another peer is evaluating the same; waiting")
                waited = True
            if stop is not None:
                stop.check()
            time.sleep(self.poll_s)


def _take(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _holder_alive(lock: Path) -> bool:
    try:
        pid = int(lock.read_text() or "0")
    except (OSError, ValueError):
        return True  # being written, or just removed: look again
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large (a corrupt lock file)
        return False
    except PermissionError:
        return True
    return True


def _read(path: Path, warned: set[Path] | None = None) -> EvalResult | None:
    """The result at `path`; None when there is none or it is not one (a malformed file is as good as absent:
    this peer evaluates itself, and its result replaces the file). A malformed file is warned about once per
    `warned` set (a waiter reads it on every poll)."""
    try:
        text = path.read_text()
    except OSError:
        return None  # not there (yet)
    try:
        return _result(json.loads(text))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        if warned is None or path not in warned:
            log.warning("%s is not an evaluation result (%s); ignored, evaluating here", path, exc)
            if warned is not None:
                warned.add(path)
        return None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers_by_name(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _number(v) for k, v in value.items())


# What each field of a stored EvalResult may hold; anything else makes the file no result (ValueError).
_CHECKS: dict[str, Callable[[object], bool]] = {
    "accuracy": _number,
    "by_dataset": _numbers_by_name,
    "seconds": _number,
    "size": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "baseline": lambda v: v is None or _number(v),
    "scores": lambda v: isinstance(v, list) and all(_number(x) for x in v),
    "answers": lambda v: isinstance(v, list) and all(x is None or isinstance(x, str) for x in v),
    "datasets": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "outside": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "distinct_gold": lambda v: v is None or _number(v),
    "baseline_by_dataset": _numbers_by_name,
    "unseen": lambda v: v is None or isinstance(v, dict),  # checked in full by its own _result
    "engine": lambda v: isinstance(v, str),
}


def _result(data: object) -> EvalResult:
    """An EvalResult from its JSON form (dataclasses.asdict); ValueError if `data` is not one."""
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    if "accuracy" not in data:
        raise ValueError("no accuracy")
    for name, value in data.items():
        check = _CHECKS.get(name)
        if check is None:
            raise ValueError(f"unknown field {name!r}")
        if not check(value):
            raise ValueError(f"{name}: {value!r:.60} is not what an evaluation result holds")
    fields = dict(data)
    unseen = fields.pop("unseen", None)
    return EvalResult(**fields, unseen=_result(unseen) if unseen is not None else None)
