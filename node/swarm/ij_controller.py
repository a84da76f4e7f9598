"""Controllers that choose the local/external split (I/J) of a SAPO node, round by round.

Each round a node trains on ``I`` local rollout groups and ``J`` groups taken from other peers,
with ``I + J = total`` fixed.  A controller (:class:`IJController`) says which ``J`` to use next round
(``current_j()``; the round loop asks for the split ``split() -> (I, J)``, which keeps at least one local
group under an adaptive controller) and learns from what the round produced (``update(obs)``).

Three controllers are provided (``make_ij_controller(name, total, initial_j, **kwargs)``):

``fixed``
    ``J`` never changes.  The paper's splits (8/0, 6/2, 4/4, 2/6) are fixed ones.

``ema``  (params ``alpha`` = 2.0, ``ema_beta`` = 0.9)
    The rule from the SAPO thesis/notes, exactly::

        d     = r_t - m_{t-1}                       # reward minus its EMA *before* this round
        J_t   = clip(J_{t-1} + alpha * d, 0, total)  # J kept as a float internally
        m_t   = ema_beta * m_{t-1} + (1 - ema_beta) * r_t
        with m initialised to the first reward seen (so the first update does not move J).

    ``current_j()`` = ``floor(J + 0.5)`` (round half up), clipped to ``[0, total]``.

    Sign convention: a reward *above* its EMA increases J.  Rationale and caveats:

    * Timing: the reward measured in round t is the reward of the policy produced by the updates of
      rounds < t, so ``r_t - m_{t-1}`` is a (smoothed) measure of how much the recent training mixes
      helped.  When they helped, the rule keeps pushing in the direction "more sharing"; when the
      reward falls below its trend (the "learn, then forget" oscillation the paper reports for
      2/6), J is pulled down, toward more on-policy local data.  This asymmetry is the intended
      prior: sharing helped in every split the paper tried, forgetting shows up as drops.
    * It is *not* a gradient estimate: it never checks whether the reward rose *because* J rose.
      During a learning phase reward rises under any split, so J drifts up; on a plateau
      ``r - EMA`` averages zero and J does a random walk driven by sampling noise.  The per-round
      noise of ``reward_mean`` (about ``sqrt(p(1-p)/(I*G))``, ~0.09 for I*G = 32 binary rewards)
      is far larger than the per-round effect of J, so keep ``alpha`` small enough that
      ``alpha * noise`` is well under one group per round (the default 2.0 gives ~0.2).
    * A round with no local groups (J = total) has no local reward (``reward_mean`` is NaN): the
      rule cannot measure anything there, so on a NaN reward J is set to ``min(J, total - 1)``
      (otherwise J = total would be absorbing); the EMA is left unchanged.

``usefulness``  (this project's design; params below)
    Steers J toward the share of *learning signal* the external groups carry, with a guard
    against forgetting.  The per-round reward change is too noisy to credit to J (see above),
    but the advantage statistics of each round are nearly noise-free and immediate: a group
    whose G rewards are all equal contributes no gradient, and a group's mean |advantage| is the
    gradient weight it carries.  External groups come pre-filtered to nonzero advantage, which is
    the mechanism by which SAPO helps: they supply signal when a node's own tasks are too easy or
    too hard for it.  Update, per round (all EMAs initialised with their first observation)::

        u_loc <- EMA_beta(local_signal_frac * local_adv_abs_mean)   if num_local > 0
                 (or with observation 0 if local_signal_frac == 0)
        u_ext <- EMA_beta(external_adv_abs_mean)             if num_external > 0
                 (before the first external measurement u_ext is taken equal to u_loc:
                  an uninformed prior that gives the paper's best split, total/2)
        avail <- EMA_beta(external_available)
        share  = u_ext / (u_ext + u_loc)                      (0.5 if both are 0)
        J*     = clip(min(total * share, avail), j_min, j_max)
        fast  <- EMA_fast_beta(r),  slow <- EMA_slow_beta(r)  (r = reward_mean, skipped if NaN)
        if slow - fast > drop_tol:                            # reward fell: forgetting guard
            J <- max(j_min, J - guard_step)
        else:
            J <- J + clip(J* - J, -step, +step)               # rate-limited move toward J*
        J <- clip(J, j_min, j_max)

    Per training slot: a local slot yields a group with signal only with probability
    ``local_signal_frac`` (zero-advantage local groups are dropped, node.learn.groups.select_groups), and
    then carries ``local_adv_abs_mean`` (mean |advantage| over the local groups used, i.e. the
    nonzero ones); an external slot always carries a pre-filtered nonzero group.  Hence
    ``u_loc = local_signal_frac * local_adv_abs_mean`` vs ``u_ext = external_adv_abs_mean``
    (a NaN ``local_signal_frac`` counts as 1).  The availability cap keeps J from taking slots
    away from local data when the swarm cannot fill them.
    Defaults: ``beta`` 0.8, ``step`` 0.5, ``j_max`` = total - 1 (always keep one local group: the
    on-policy anchor, and the only source of ``reward_mean``), ``j_min`` = min(1, j_max) (one probe
    group keeps the external usefulness measurable; pass 0 to allow silo), ``fast_beta`` 0.7,
    ``slow_beta`` 0.95, ``drop_tol`` 0.1 (absolute reward units), ``guard_step`` 1.0.
    ``initial_j`` is clipped into ``[j_min, j_max]``.

All controllers ignore an observation whose ``round`` is not greater than the last one they saw
(replays after a checkpoint resume), keep a JSON-safe ``state_dict()`` and accept it back with
``load_state_dict()``.

Why this module is long: 80 of its lines are this specification of the three controllers; the code
itself is three small classes that share one interface, and splitting them would scatter the spec.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from node.learn.choices import IJ_POLICIES
from node.learn.groups import Group, Selection, mean_abs_advantage, mean_reward

log = logging.getLogger(__name__)

__all__ = [
    "RoundObservation",
    "IJController",
    "FixedController",
    "EMAController",
    "UsefulnessController",
    "CONTROLLER_NAMES",
    "make_ij_controller",
]


@dataclass(frozen=True)
class RoundObservation:
    """What one training round produced, as seen by the I/J controller (`of` builds it from the round)."""

    round: int
    # mean reward of this round's local groups (all G completions of the I local tasks); 0 if I = 0
    reward_mean: float
    num_local: int  # local groups actually used in training
    num_external: int  # external groups actually used in training
    external_available: int  # verified external groups with nonzero advantage that were available
    local_signal_frac: float  # fraction of local groups with nonzero advantage
    external_signal_frac: float  # fraction of verified external groups with nonzero advantage (nan/0 if none)
    external_adv_abs_mean: float  # mean |advantage| over external groups used (0 if none)
    local_adv_abs_mean: float  # mean |advantage| over local groups used (zero-advantage ones are dropped first)

    @classmethod
    def of(cls, r: int, local: list[Group], selection: Selection) -> RoundObservation:
        """Round `r`'s observation: the groups we sampled (`local`) and what was selected out of all on offer."""
        return cls(
            round=r,
            reward_mean=mean_reward(local),
            num_local=len(selection.local),
            num_external=len(selection.external),
            external_available=selection.external_available,
            local_signal_frac=selection.local_signal_frac,
            external_signal_frac=selection.external_signal_frac,
            external_adv_abs_mean=mean_abs_advantage(selection.external),
            local_adv_abs_mean=mean_abs_advantage(selection.local),
        )


@runtime_checkable
class IJController(Protocol):
    name: str

    def current_j(self) -> int:
        """J the controller aims at for next round."""
        ...

    def split(self) -> tuple[int, int]:
        """(I, J) to use next round: what the round loop asks."""
        ...

    def update(self, obs: RoundObservation) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, d: dict) -> None: ...


# ----------------------------------------------------------------------------- helpers


def _clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _opt_float(x: Any) -> float | None:
    """JSON-safe float: None for missing / NaN."""
    return float(x) if x is not None and _finite(x) else None


def _ema(prev: float | None, x: float, beta: float) -> float:
    return x if prev is None else beta * prev + (1.0 - beta) * x


def _check_prob(name: str, v: Any, *, allow_one: bool = False) -> float:
    if not _finite(v) or isinstance(v, bool):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    v = float(v)
    if not (0.0 <= v < 1.0 or (allow_one and v == 1.0)):
        raise ValueError(f"{name} must be in [0, 1), got {v}")
    return v


def _check_nonneg(name: str, v: Any) -> float:
    if not _finite(v) or isinstance(v, bool):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    v = float(v)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


class _Base:
    name = "base"

    def __init__(self, total: int, initial_j: int):
        self.total = int(total)
        self.j = float(initial_j)
        self.last_round: int | None = None
        self.updates = 0

    # -- protocol
    def current_j(self) -> int:
        return int(_clip(_round_half_up(self.j), 0, self.total))

    def split(self) -> tuple[int, int]:
        """(I, J) for the next round, I + J = total. An adaptive controller keeps at least one local group: this
        node always contributes to the swarm, and its own groups are where its reward is measured."""
        j = min(self.current_j(), max(self.total - 1, 0))
        return self.total - j, j

    def update(self, obs: RoundObservation) -> None:
        r = int(obs.round)
        if self.last_round is not None and r <= self.last_round:
            log.warning(
                "%s I/J controller: ignoring observation for round %d (last seen %d)", self.name, r, self.last_round
            )
            return
        self.last_round = r
        self.updates += 1
        self._update(obs)

    def _update(self, obs: RoundObservation) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _params(self) -> dict:
        return {}

    def _extra_state(self) -> dict:
        return {}

    def _load_extra(self, d: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {
            "name": self.name,
            "total": self.total,
            "j": float(self.j),
            "last_round": self.last_round,
            "updates": self.updates,
            "params": self._params(),
            **self._extra_state(),
        }

    def load_state_dict(self, d: dict) -> None:
        if not isinstance(d, dict):
            raise ValueError(f"state_dict must be a dict, got {type(d).__name__}")
        if d.get("name") != self.name:
            raise ValueError(f"state_dict is for I/J controller {d.get('name')!r}, not {self.name!r}")
        if int(d.get("total", -1)) != self.total:
            raise ValueError(f"state_dict has total={d.get('total')!r}, this controller has total={self.total}")
        j: Any = d.get("j")
        if not _finite(j):
            raise ValueError(f"state_dict has invalid j={j!r}")
        self.j = _clip(float(j), 0.0, float(self.total))
        lr = d.get("last_round")
        self.last_round = None if lr is None else int(lr)
        self.updates = int(d.get("updates", 0))
        self._load_extra(d)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(total={self.total}, j={self.j:.3f}, params={self._params()})"


# ----------------------------------------------------------------------------- fixed


class FixedController(_Base):
    """J never changes."""

    name = "fixed"

    def split(self) -> tuple[int, int]:
        """The configured (I, J), as given."""
        j = self.current_j()
        return self.total - j, j

    def _update(self, obs: RoundObservation) -> None:
        pass


# ----------------------------------------------------------------------------- ema


class EMAController(_Base):
    """J <- clip(J + alpha * (r - EMA(r)), 0, total); see the module docstring."""

    name = "ema"

    def __init__(self, total: int, initial_j: int, alpha: float = 2.0, ema_beta: float = 0.9):
        super().__init__(total, initial_j)
        self.alpha = _check_nonneg("alpha", alpha)
        self.ema_beta = _check_prob("ema_beta", ema_beta)
        self.ema: float | None = None

    def _update(self, obs: RoundObservation) -> None:
        r = obs.reward_mean
        if not _finite(r):
            # no local reward measured (I = 0): step back into the measurable region
            self.j = min(self.j, float(max(self.total - 1, 0)))
            return
        r = float(r)
        if self.ema is None:
            self.ema = r
            return
        d = r - self.ema
        self.j = _clip(self.j + self.alpha * d, 0.0, float(self.total))
        self.ema = self.ema_beta * self.ema + (1.0 - self.ema_beta) * r

    def _params(self) -> dict:
        return {"alpha": self.alpha, "ema_beta": self.ema_beta}

    def _extra_state(self) -> dict:
        return {"ema": _opt_float(self.ema)}

    def _load_extra(self, d: dict) -> None:
        self.ema = _opt_float(d.get("ema"))


# ----------------------------------------------------------------------------- usefulness


class UsefulnessController(_Base):
    """Move J toward total * u_ext / (u_ext + u_loc), capped by availability, with a reward-drop guard."""

    name = "usefulness"

    def __init__(
        self,
        total: int,
        initial_j: int,
        beta: float = 0.8,
        step: float = 0.5,
        j_min: float | None = None,
        j_max: float | None = None,
        fast_beta: float = 0.7,
        slow_beta: float = 0.95,
        drop_tol: float = 0.1,
        guard_step: float = 1.0,
    ):
        super().__init__(total, initial_j)
        self.beta = _check_prob("beta", beta)
        self.step = _check_nonneg("step", step)
        self.fast_beta = _check_prob("fast_beta", fast_beta)
        self.slow_beta = _check_prob("slow_beta", slow_beta)
        self.drop_tol = _check_nonneg("drop_tol", drop_tol)
        self.guard_step = _check_nonneg("guard_step", guard_step)
        self.j_max = float(max(total - 1, 0)) if j_max is None else _check_nonneg("j_max", j_max)
        self.j_min = min(1.0, self.j_max) if j_min is None else _check_nonneg("j_min", j_min)
        if self.j_max > total:
            raise ValueError(f"j_max={self.j_max} exceeds total={total}")
        if self.j_min > self.j_max:
            raise ValueError(f"j_min={self.j_min} > j_max={self.j_max}")
        self.j = _clip(self.j, self.j_min, self.j_max)
        self.u_loc: float | None = None
        self.u_ext: float | None = None
        self.avail: float | None = None
        self.fast: float | None = None
        self.slow: float | None = None
        self.last_target: float | None = None
        self.guard_active = False

    def target(self) -> float:
        """J* from the current usefulness estimates (before rate limiting)."""
        u_loc = self.u_loc if self.u_loc is not None else 0.0
        u_ext = self.u_ext if self.u_ext is not None else u_loc  # uninformed prior
        s = u_ext + u_loc
        share = 0.5 if s <= 0 else u_ext / s
        j = self.total * share
        if self.avail is not None:
            j = min(j, self.avail)
        return _clip(j, self.j_min, self.j_max)

    def _update(self, obs: RoundObservation) -> None:
        lsf = float(obs.local_signal_frac) if _finite(obs.local_signal_frac) else 1.0
        if obs.num_local > 0 and _finite(obs.local_adv_abs_mean):
            self.u_loc = _ema(self.u_loc, _clip(lsf, 0.0, 1.0) * abs(float(obs.local_adv_abs_mean)), self.beta)
        elif lsf == 0.0:  # every local group had zero advantage: none used, no signal locally
            self.u_loc = _ema(self.u_loc, 0.0, self.beta)
        if _finite(obs.external_available):
            self.avail = _ema(self.avail, max(0.0, float(obs.external_available)), self.beta)
        if obs.num_external > 0 and _finite(obs.external_adv_abs_mean):
            self.u_ext = _ema(self.u_ext, abs(float(obs.external_adv_abs_mean)), self.beta)
        if _finite(obs.reward_mean):
            r = float(obs.reward_mean)
            self.fast = _ema(self.fast, r, self.fast_beta)
            self.slow = _ema(self.slow, r, self.slow_beta)
        tgt = self.target()
        self.last_target = tgt
        self.guard_active = self.fast is not None and self.slow is not None and (self.slow - self.fast) > self.drop_tol
        if self.guard_active:
            j = max(self.j_min, self.j - self.guard_step)
        else:
            j = self.j + _clip(tgt - self.j, -self.step, self.step)
        self.j = _clip(j, self.j_min, self.j_max)

    def current_j(self) -> int:
        return int(_clip(_round_half_up(self.j), self.j_min, self.j_max))

    def _params(self) -> dict:
        return {
            "beta": self.beta,
            "step": self.step,
            "j_min": self.j_min,
            "j_max": self.j_max,
            "fast_beta": self.fast_beta,
            "slow_beta": self.slow_beta,
            "drop_tol": self.drop_tol,
            "guard_step": self.guard_step,
        }

    def _extra_state(self) -> dict:
        return {
            "u_loc": _opt_float(self.u_loc),
            "u_ext": _opt_float(self.u_ext),
            "avail": _opt_float(self.avail),
            "fast": _opt_float(self.fast),
            "slow": _opt_float(self.slow),
            "last_target": _opt_float(self.last_target),
            "guard_active": bool(self.guard_active),
        }

    def _load_extra(self, d: dict) -> None:
        self.j = _clip(self.j, self.j_min, self.j_max)
        for k in ("u_loc", "u_ext", "avail", "fast", "slow", "last_target"):
            setattr(self, k, _opt_float(d.get(k)))
        self.guard_active = bool(d.get("guard_active", False))


# ----------------------------------------------------------------------------- factory

_REGISTRY: dict[str, Callable[..., _Base]] = {
    cls.name: cls for cls in (FixedController, EMAController, UsefulnessController)
}
CONTROLLER_NAMES: tuple[str, ...] = IJ_POLICIES  # what --ij-policy accepts (node/learn/choices.py); each one is
# in _REGISTRY (tests/swarm/test_ij_controller.py builds every name)
_PARAMS: dict[str, tuple[str, ...]] = {
    "fixed": (),
    "ema": ("alpha", "ema_beta"),
    "usefulness": ("beta", "step", "j_min", "j_max", "fast_beta", "slow_beta", "drop_tol", "guard_step"),
}


def make_ij_controller(name: str, total: int, initial_j: int, **kwargs: Any) -> IJController:
    """Build an I/J controller.  ``total`` = I + J (fixed), ``initial_j`` = J for the first round.

    Raises ValueError for an unknown name, an unknown or out-of-range parameter, or a bad split.
    """
    key = str(name).strip().lower()
    if key not in _REGISTRY:
        raise ValueError(f"unknown I/J controller {name!r}; choose one of {', '.join(CONTROLLER_NAMES)}")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total (I + J) must be a non-negative int, got {total!r}")
    if isinstance(initial_j, bool) or not isinstance(initial_j, int) or not 0 <= initial_j <= total:
        raise ValueError(f"initial_j must be an int in [0, total={total}], got {initial_j!r}")
    unknown = sorted(set(kwargs) - set(_PARAMS[key]))
    if unknown:
        allowed = ", ".join(_PARAMS[key]) or "none"
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for I/J controller {key!r} (allowed: {allowed})")
    return _REGISTRY[key](total, initial_j, **kwargs)
