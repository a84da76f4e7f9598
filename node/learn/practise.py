"""--practise: the part of its task mix a node samples its own tasks from. The rest of the mix it still learns
from peers' groups (`TaskMix.allows` stays the whole mix's), so peers that practise different parts share.

Parsed here, free of torch and reasoning-gym, so that the config refuses a malformed value in one line before
anything loads (`parse`); checked against the task mix once that is resolved (`practised`).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.learn.tasks import TaskMix

ITEM = re.compile(r"([A-Za-z0-9_]+)\s*(?::\s*(.*))?")


def parse(text: str) -> dict[str, float | None]:
    """`name` or `name:weight` items, comma-separated, in the order given -> {name: weight, or None for the
    mix's own}; {} for an empty value (the whole mix). ValueError saying what is wrong."""
    out: dict[str, float | None] = {}
    if not text.strip():
        return out
    for item in text.split(","):
        match = ITEM.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"takes dataset names of the task mix, optionally with weights (a,b:3); not {item!r}")
        name, raw = match.groups()
        if name in out:
            raise ValueError(f"names {name} twice")
        weight = None
        if raw is not None:
            try:
                weight = float(raw)
            except ValueError:
                weight = math.nan
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"needs a positive weight for {name} (got {raw!r})")
        out[name] = weight
    return out


def practised(mix: TaskMix, text: str) -> dict[str, float]:
    """The datasets the node samples its own tasks from and their weights, in the mix's order: the whole
    mix's, with its weights, when `text` is empty (so the sampler draws exactly as it did before the option);
    else the datasets named, each at its given weight or the mix's. ValueError naming what the mix lacks."""
    given = parse(text)
    unknown = [name for name in given if name not in mix.datasets]
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: not in the task mix {mix.name} (its datasets: {', '.join(mix.datasets)})"
        )
    names = [name for name in mix.datasets if not given or name in given]
    return {name: given.get(name) or float(mix.datasets[name].get("weight", 1.0)) for name in names}
