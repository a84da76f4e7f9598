"""What a running node shows while it works: the live state the status server reads, and per-phase timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class LiveState:
    """What the status server and progress view read; updated by the loop, never blocking it."""

    phase: str = "starting"
    round: int = 0
    started_at: float = field(default_factory=time.time)
    history: list = field(default_factory=list)
    last_round_at: float | None = None
    last_eval: dict | None = None  # the newest held-out evaluation: round, accuracy, per dataset, seconds
    last_guard: dict | None = None  # the collapse guard's newest restore: round, reason, restored_to


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
