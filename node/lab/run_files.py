"""One run's files as the report reads them: a metrics line (a record, or corrupt: skipped and counted) and a
run.json (its fields, or why it cannot be the run's record), each checked for the types the report relies on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypeGuard

import orjson

MAX_ROUND = 10**9  # a metrics line's round beyond this (or below 0) is corrupt, not a run that long

# The fields of a metrics line the report reads, by type: a line that carries one of them as anything else
# (null aside) is corrupt, skipped and counted, rather than read as "not logged".
_NUMBER_KEYS = (
    "num_local",
    "num_external",
    "target_external",
    "external_accepted",
    "external_rejected",
    "round_s",
    "eval_accuracy",
    "eval_baseline",
    "eval_distinct_answers",
    "eval_distinct_gold",
    "eval_unseen_accuracy",
    "eval_unseen_baseline",
    "entropy_mean",
    "signal_frac",
    "local_signal_frac",
    "tokens_generated",
    "start_accuracy",
)
_TEXT_KEYS = ("ij_policy", "model", "publisher", "eval_engine")
# The run.json fields the report reads, by type (null counts as absent); one of another type makes the run.json
# malformed. Ints are not bools, and never negative but for the seed.
_RUN_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "config_name": (str,),
    "seed": (int, str),
    "num_local": (int,),
    "num_external": (int,),
    "ij_policy": (str,),
    "peers": (int,),
    "rounds": (int,),
    "model": (str,),
    "models": (list,),  # of strings
}
_TYPE_NAMES = {str: "a string", int: "an integer", list: "a list of strings"}


def _is_number(x: Any) -> TypeGuard[int | float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_metrics_line(raw: bytes) -> dict | None:
    """Parsed record, or None when the line is corrupt."""
    try:
        obj = orjson.loads(raw)
    except Exception:
        return None
    if not isinstance(obj, dict):
        return None
    r = obj.get("round")
    if not _is_number(r) or not math.isfinite(r) or r != int(r) or not 0 <= r <= MAX_ROUND:
        return None
    if "reward_mean" not in obj:
        return None
    rm = obj["reward_mean"]
    if rm is not None and not _is_number(rm):
        return None
    if any(obj.get(k) is not None and not _is_number(obj[k]) for k in _NUMBER_KEYS):
        return None
    if any(obj.get(k) is not None and not isinstance(obj[k], str) for k in _TEXT_KEYS):
        return None
    return obj


def json_value(path: Path) -> tuple[Any, str]:
    """A JSON file's value and "", or (None, why): not a regular file (a FIFO would block), unreadable, or not
    JSON (nesting too deep included)."""
    if not path.is_file():
        return None, "not a regular file"
    try:
        return json.loads(path.read_bytes()), ""
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    except (ValueError, RecursionError) as e:
        return None, f"not valid JSON ({(str(e).splitlines() or ['nested too deep'])[0]})"


def read_run_json(path: Path) -> dict:
    """A run.json's fields; {} when it is missing or unreadable (the report checks it: `run_meta`)."""
    d, _ = json_value(path)
    return d if isinstance(d, dict) else {}


def run_meta(path: Path) -> tuple[dict, str]:
    """A run.json's fields and "", or ({}, why) when it cannot be the run's record: not a regular file,
    unreadable, not a JSON object, or a field the report reads (`_RUN_JSON_TYPES`) of the wrong type."""
    d, why = json_value(path)
    if why:
        return {}, f"malformed run.json: {why}"
    if not isinstance(d, dict):
        return {}, f"malformed run.json: a JSON {type(d).__name__}, not an object"
    for key, types in _RUN_JSON_TYPES.items():
        v = d.get(key)
        ok = v is None or (isinstance(v, types) and not isinstance(v, bool))
        if ok and isinstance(v, int):
            ok = key == "seed" or v >= 0
        if ok and isinstance(v, list):
            ok = all(isinstance(m, str) for m in v)
        if not ok:
            want = " or ".join(_TYPE_NAMES[t] for t in types) + (
                " >= 0" if key in ("num_local", "num_external", "peers", "rounds") else ""
            )
            return {}, f"malformed run.json: {key} is {json.dumps(v)[:40]}, not {want}"
    return d, ""
