"""reasoning-gym, imported lean: the one door through which the node reaches its datasets.

`import reasoning_gym` imports every dataset module. Some of them import what no preset needs at each node
start: cellpylib and with it matplotlib (two cellular-automaton datasets), and sympy (the algebra, games and
geometry subpackages). Those are stand-ins until first used (node.lazy), so a dataset of theirs is
registered only once its subpackage loads: look datasets up through `datasets()` and create them through
`create_dataset`, which load the deferred subpackages when a name is not registered yet.
"""

from __future__ import annotations

import sys
from typing import Any

from node.lazy import import_lazily, load_now
from node.learn.answer_guard import EVAL_SCORER_MODULES, literal_eval

DEFERRED = ("reasoning_gym.algebra", "reasoning_gym.games", "reasoning_gym.geometry")
for _name in ("cellpylib", *DEFERRED):  # before reasoning_gym imports them
    import_lazily(_name)
import reasoning_gym  # noqa: E402


def datasets() -> dict[str, Any]:
    """reasoning-gym's registry of every dataset (name -> its dataset and config classes)."""
    for name in DEFERRED:
        load_now(name)
    return reasoning_gym.factory.DATASETS


def is_dataset(name: str) -> bool:
    return name in reasoning_gym.factory.DATASETS or name in datasets()


def create_dataset(name: str, **kwargs: Any):
    """reasoning_gym.create_dataset; a composite dataset may name any other, so it sees them all. No scorer of
    a dataset made here evaluates its answer as Python (`guard_scorers`)."""
    if name == "composite" or name not in reasoning_gym.factory.DATASETS:
        datasets()
    guard_scorers()
    return reasoning_gym.create_dataset(name, **kwargs)


def guard_scorers() -> None:
    """The scorers that `eval` an answer get `literal_eval` as their `eval` (a module's own name comes before
    the builtin): a peer's completion is scored, never run (node/learn/answer_guard.py). Modules not imported
    yet are guarded by the call that follows their import."""
    for name in EVAL_SCORER_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            module.eval = literal_eval  # type: ignore[attr-defined]
