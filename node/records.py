"""What a round leaves behind: its metrics.jsonl record, its log line and its entry in the live history, and
the status snapshot that /status, /metrics and the dashboard render.

Plain functions of what they are given: the loop names every input at the call site, so a reader (or a
call-graph tool) follows the round into its record. Kept out of node/loop.py so that the loop reads as the
algorithm. The only state is `NodeTotals`, the running counters (and the ids of the external groups trained on
lately, which the selection leaves out: the one thing here that changes what the node learns), and
`QuietRounds`, the stretch of rounds without an update.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from node import __version__
from node.learn.groups import Group, Selection, collapse_metrics, mean_reward
from node.learn.sampling import SampledGroup
from node.learn.screen import ScreenReport
from node.learn.trainer import StepStats
from node.ops.config import NodeConfig
from node.ops.live import LiveState, PhaseTimer
from node.swarm.exchange import Exchange, ExchangeStats, RoundCounts
from node.swarm.pipeline import Arrival, NetPipeline

log = logging.getLogger("sapo.node")

QUIET_ROUNDS = 5  # rounds in a row without an update after which the node says it is learning nothing
HISTORY_ROUNDS = 500  # rounds the live history keeps (status, dashboard)
SOURCE_PREFIX = 16  # hex digits of a publisher key that name it in a record
NETWORK_HISTORY = ("external_age_s", "external_age_rounds", "prefetch_waited", "net_pipeline")  # the lag (status)
LAG_ROUNDS = 20  # rounds over which /status and the progress line give the network's lag
# Learning-health keys kept in the live history (status, dashboard)
HISTORY_EXTRA = (
    "entropy_mean",
    "signal_frac",
    "local_signal_frac",
    "eval_accuracy",
    "eval_unseen_accuracy",
    "lr",
    "guard_restores",
    "eval_next",
    "screened_by_reason",
    "screened_tokens_frac",
    "canary_share",
)
MAX_SCREENED_PUBLISHERS = 64  # publishers whose screened completions the totals keep (most screened first)


@dataclass
class NodeTotals:
    """Counters since the run began (checkpointed, so a resumed run goes on counting), and the external groups
    trained on lately: a restarted node's verifier has forgotten which batches it judged, and a batch stays in
    the fetch window for minutes, so without them a resumed node could train on a group a second time."""

    rounds: int = 0
    tokens_generated: int = 0
    groups_local: int = 0
    groups_external: int = 0
    dropped_zero_adv: int = 0
    recent_external: list[str] = field(default_factory=list)  # group_id of the last RECENT_EXTERNAL trained on
    screened: dict[str, int] = field(default_factory=dict)  # the external screen's drops and masks, by reason
    screened_by_publisher: dict[str, int] = field(default_factory=dict)  # completions screened, per publisher

    def add(self, selection: Selection, tokens: int, screen: ScreenReport | None = None) -> None:
        """One completed round (`screen`: what the external screen did in its update)."""
        if screen is not None:
            for reason, n in screen.by_reason.items():
                self.screened[reason] = self.screened.get(reason, 0) + n
            for pub, row in screen.by_publisher.items():
                n = sum(v for k, v in row.items() if k != "masked_tokens")
                self.screened_by_publisher[pub] = self.screened_by_publisher.get(pub, 0) + n
            top = sorted(self.screened_by_publisher.items(), key=lambda kv: -kv[1])[:MAX_SCREENED_PUBLISHERS]
            self.screened_by_publisher = dict(top)
        self.rounds += 1
        self.tokens_generated += tokens
        self.groups_local += len(selection.local)
        self.groups_external += len(selection.external)
        self.dropped_zero_adv += selection.dropped_local + selection.dropped_external
        self.recent_external = (self.recent_external + [group_id(g) for g in selection.external])[-RECENT_EXTERNAL:]

    def fresh(self, external: list[Group]) -> list[Group]:
        """The external groups not trained on already (by this run, before a restart included)."""
        seen = set(self.recent_external)
        return [g for g in external if group_id(g) not in seen]

    def state_dict(self) -> dict[str, Any]:
        """The counters as a checkpoint keeps them; the screen's only once it screened something, so that a
        run without external groups keeps exactly the state it had before the screen existed."""
        state = {**vars(self), "recent_external": list(self.recent_external)}
        for key in ("screened", "screened_by_publisher"):
            state.pop(key)
            if getattr(self, key):
                state[key] = dict(getattr(self, key))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fresh = NodeTotals(**state)  # a checkpoint from before recent_external or the screen: those empty
        vars(self).update({**vars(fresh), "recent_external": list(fresh.recent_external)})


RECENT_EXTERNAL = 1024  # a batch lives 10 minutes in the fetch window: far fewer groups than this at any J


def group_id(g: Group) -> str:
    """An external group as publisher/dataset/seed/index: a publisher never sends two tasks under one spec, and
    a resumed publisher redoes its rounds with the same specs, so the same id twice is the same group."""
    s = g.task.spec
    return f"{g.source[:SOURCE_PREFIX]}/{s.dataset}/{s.seed}/{s.index}"


@dataclass
class QuietRounds:
    """A node can run round after round without an update (every group on offer scored alike) and look busy
    while learning nothing: it says so once per such stretch, with the usual causes."""

    rounds_without_update: int = 0  # in a row, this run (a warning at QUIET_ROUNDS)

    def saw(self, r: int, steps: int) -> None:
        """Round r took `steps` optimizer steps."""
        self.rounds_without_update = 0 if steps else self.rounds_without_update + 1
        if self.rounds_without_update == QUIET_ROUNDS:
            log.warning(
                "no update in rounds %d-%d: in every group on offer the completions scored alike (all "
                "wrong, or all right), so there was no advantage to learn from. The tasks may be beyond "
                "this model or too easy for it (--tasks), or the policy has collapsed (the collapse guard "
                "acts at held-out evaluations)",
                r - QUIET_ROUNDS + 1,
                r,
            )


def tokens_generated(sampled: list[SampledGroup]) -> int:
    return sum(len(ids) for s in sampled for ids in s.completion_ids)


def round_record(
    r: int,
    timer: PhaseTimer,
    local: list[Group],
    external: list[Group],
    selection: Selection,
    target: tuple[int, int],
    stats: StepStats,
    tokens: int,
) -> dict[str, Any]:
    """What the round did, for its metrics.jsonl line (`round_context` adds the swarm's side and the node's
    name): `local` are the groups we sampled, `external` the verified ones we received, `selection` what was
    trained on out of them, `target` the (I, J) the policy asked for."""
    rewards = [x for g in local for x in g.rewards]
    phase_s = {k: round(v, 4) for k, v in timer.seconds.items()}
    return {
        "round": r,
        "t_start": timer.t0,
        "t_end": time.time(),
        "round_s": round(time.time() - timer.t0, 4),
        "phase_s": phase_s,
        # the round's time on the swarm: publishing, fetching and verifying what came
        "swarm_io_s": round(sum(phase_s.get(p, 0.0) for p in ("publish", "fetch", "verify")), 4),
        "reward_mean": mean_reward(local),
        "reward_max": float(max(rewards)) if rewards else 0.0,
        "local_signal_frac": selection.local_signal_frac,
        "target_local": target[0],
        "target_external": target[1],
        "num_local": len(selection.local),
        "num_external": len(selection.external),
        "dropped_zero_adv_local": selection.dropped_local,
        "dropped_zero_adv_external": selection.dropped_external,
        "external_available": selection.external_available,
        "external_sources": _count_sources(selection.external),
        "external_groups": [group_id(g) for g in selection.external],  # the same id twice: trained on twice
        "loss": stats.loss,
        "kl": stats.kl,
        "clip_frac": stats.clip_frac,
        "ratio_mean": stats.ratio_mean,
        "grad_norm": stats.grad_norm,
        "optimizer_steps": stats.optimizer_steps,
        "train_sequences": stats.sequences,  # with --external-loss positive/ftis, fewer than the groups hold
        "external_weight": stats.external_weight,  # mean min(1, pi_old/mu) of weighted external completions
        # what the external screen dropped and masked of other peers' right answers, and why (node/learn/screen.py)
        **(stats.screen.to_record() if stats.screen is not None else {"external_screen": "off"}),
        "tokens_generated": tokens,
        **collapse_metrics(local, external),
    }


def round_context(
    counts: RoundCounts, exchange: ExchangeStats, peak_mem_mb: float, cfg: NodeConfig, publisher: str
) -> dict[str, Any]:
    """The rest of the round's metrics.jsonl line: what the swarm brought and refused (`counts`: the verification
    whose groups this round took, which ran behind an earlier round when the network is pipelined), the memory
    peak, and which node this is (`publisher`: its public key)."""
    return {
        "external_accepted": counts.accepted,
        "external_rejected": sum(counts.rejected.values()),
        "rejected_by_reason": dict(counts.rejected),
        "verified_batches": counts.verified,
        "verify_bytes": counts.verify_bytes,
        "verify_s": round(counts.verify_s, 4),
        # groups whose right answers carry their publisher's recurring text (node/swarm/screening.py)
        "foreign_text_by_publisher": dict(counts.foreign),
        "swarm_state": exchange.round_swarm_state,  # joined, solo (waiting for peers: nothing shared) or silo
        **({"solo_since": exchange.round_solo_since} if exchange.round_solo_since is not None else {}),
        "publisher": publisher[:SOURCE_PREFIX] or None,  # this peer as the others' external_sources name it
        "peak_mem_mb": round(peak_mem_mb, 1),
        "ij_policy": cfg.ij_policy,
        "model": cfg.model,  # peers of a mixed swarm run different models (progress view, report)
    }


def network_record(r: int, arrival: Arrival, trained: list[Group], net: NetPipeline) -> dict[str, Any]:
    """How far behind the round the network ran: the age of each external group trained on, in our rounds since
    its fetch began and in seconds since its publisher signed it (its clock) to the end of this round, and what
    the fetch and verification that brought them took (`prefetch_s`, in the background unless `prefetch_waited`)."""
    now = time.time()
    return {
        "net_pipeline": net.background,
        "net_max_age": net.max_age,
        "prefetch_s": round(arrival.seconds, 4) if arrival.seconds is not None else None,
        "prefetch_waited": arrival.waited,
        "external_age_rounds": [r - g.fetch_round for g in trained if g.fetch_round is not None],
        "external_age_s": [round(max(0.0, now - g.created_at), 3) for g in trained if g.created_at is not None],
    }


def network_lag(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The swarm's lag over recent rounds (/status, the progress view): the median age of the external groups
    trained on, in seconds and rounds (None before any), and the rounds that waited for the network."""
    ages_s = [a for rec in records for a in rec.get("external_age_s", [])]
    ages_r = [a for rec in records for a in rec.get("external_age_rounds", [])]
    return {
        "median_age_s": round(statistics.median(ages_s), 3) if ages_s else None,
        "median_age_rounds": statistics.median(ages_r) if ages_r else None,
        "rounds_waited": sum(1 for rec in records if rec.get("prefetch_waited") and rec.get("net_pipeline")),
        "rounds": len(records),
    }


def remember_round(live: LiveState, record: dict[str, Any]) -> None:
    """The round's entry in the live history that /status and the dashboard show."""
    live.history.append(
        {k: record[k] for k in ("round", "reward_mean", "num_local", "num_external")}
        | {"phase_s": record["phase_s"]}
        | {k: record[k] for k in NETWORK_HISTORY if k in record}
        | {k: record[k] for k in HISTORY_EXTRA if k in record}
    )
    del live.history[:-HISTORY_ROUNDS]
    live.last_round_at = record["t_end"]


def log_line(rec: dict[str, Any]) -> str:
    """The round as one readable line of node.log."""
    p = rec["phase_s"]
    return (
        f"round {rec['round']} | reward {rec['reward_mean']:.3f} (max {rec['reward_max']:.2f}) | "
        f"local {rec['num_local']}/{rec['target_local']} ext {rec['num_external']}/{rec['target_external']} "
        f"(avail {rec['external_available']}, got {rec['external_accepted']}, rej {rec['external_rejected']}) | "
        f"dropped {rec['dropped_zero_adv_local'] + rec['dropped_zero_adv_external']} | "
        f"loss {rec['loss']:+.4f} clip {rec['clip_frac']:.3f} | gen {p.get('generate', 0):.1f}s "
        f"train {p.get('train', 0):.1f}s swarm {rec['swarm_io_s']:.2f}s"
        + _lag_text(rec)
        + (" | solo: waiting for peers" if rec.get("swarm_state") == "solo" else "")
        + _screen_part(rec)
    )


def _lag_text(rec: dict[str, Any]) -> str:
    """The network's lag behind this round: the external groups' median age, and a wait at the bound."""
    ages = rec.get("external_age_s") or []
    text = ""
    if rec.get("net_pipeline") and ages:
        rounds = statistics.median(rec.get("external_age_rounds") or [0])
        text = f" | net lag {statistics.median(ages):.1f}s ({rounds:g} rnd)"
    if rec.get("net_pipeline") and rec.get("prefetch_waited"):
        text += f" waited {rec['phase_s'].get('fetch', 0):.2f}s"
    return text


def _screen_part(rec: dict[str, Any]) -> str:
    """What the external screen dropped or masked this round, by reason and publisher ("" when nothing)."""
    reasons = rec.get("screened_by_reason") or {}
    if not reasons:
        return ""
    why = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
    who = ", ".join(
        f"{pub[:8]} {sum(v for k, v in row.items() if k != 'masked_tokens')}"
        for pub, row in sorted((rec.get("screened_by_publisher") or {}).items())
    )
    return f" | screened {why} ({rec.get('screened_tokens_frac', 0.0):.0%} of their tokens; {who})"


def status_snapshot(
    cfg: NodeConfig, live: LiveState, exchange: Exchange, totals: NodeTotals, net: dict[str, Any] | None = None
) -> dict[str, Any]:
    """JSON-safe status for /status, /metrics and the dashboard; `net`: what the network does behind the rounds
    (`NetPipeline.state`), with its lag over the last LAG_ROUNDS rounds."""
    rewards = [h["reward_mean"] for h in live.history]
    ma = rewards[-20:]
    last = live.history[-1] if live.history else None
    stats = exchange.stats
    return {
        **exchange.identity_info(),
        "swarm": cfg.swarm if cfg.swarm_enabled else "silo",
        "membership": exchange.swarm_state(),  # joined, solo ("solo: waiting for peers since ...") or silo
        "model": cfg.model,
        "version": __version__,
        "round": live.round,
        "phase": live.phase,
        "uptime_s": time.time() - live.started_at,
        "started_at": live.started_at,
        "last_reward": rewards[-1] if rewards else None,
        "reward_ma": sum(ma) / len(ma) if ma else None,
        "phase_s": last["phase_s"] if last else {},
        "history": list(live.history),
        "peers": dict(stats.peers),
        "groups": stats.to_dict(),
        "reputation": exchange.reputation.snapshot(),
        "verify": {
            "last_round_s": stats.round_verify_s,
            "last_round_bytes": stats.round_verify_bytes,
            "last_round_batches": stats.round_verified,
        },
        "network": {**(net or {}), **network_lag(live.history[-LAG_ROUNDS:])},
        "totals": totals.state_dict(),
        "last_round_at": live.last_round_at,
        "eval": live.last_eval,
        "entropy": last.get("entropy_mean") if last else None,
        "signal_frac": last.get("signal_frac") if last else None,
        "screen": {
            "mode": cfg.external_screen,
            "last_round": {k: last.get(k) for k in ("screened_by_reason", "screened_tokens_frac")} if last else {},
            "totals": dict(totals.screened),
            "by_publisher": dict(totals.screened_by_publisher),
            "canary_share": live.last_eval.get("canary_share") if live.last_eval else None,
        },
        "guard": {
            "lr": last.get("lr") if last else None,
            "restores": last.get("guard_restores", 0) if last else 0,
            "last": live.last_guard,
        },
    }


def _count_sources(groups: list[Group]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g in groups:
        counts[g.source[:SOURCE_PREFIX]] = counts.get(g.source[:SOURCE_PREFIX], 0) + 1
    return counts
