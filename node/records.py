"""What a round leaves behind: its metrics.jsonl record, its log line, the I/J controller's observation,
and the status snapshot that /status, /metrics and the dashboard render.

Kept out of node/loop.py so that the loop reads as the algorithm. Nothing here changes what the node learns:
it reads the node's state and keeps its running totals.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from node import __version__
from node.learn.groups import Group
from node.learn.grpo import group_advantages
from node.learn.trainer import StepStats
from node.ops.metrics import peak_memory_mb
from node.swarm.ij_policy import RoundObservation

log = logging.getLogger("sapo.node")


@dataclass
class NodeTotals:
    rounds: int = 0
    tokens_generated: int = 0
    groups_local: int = 0
    groups_external: int = 0
    dropped_zero_adv: int = 0


class RoundRecords:
    """SapoNode's reporting side (a mixin): reads the node's state, updates only its totals."""

    def _record(self, r, timer, local, selection, stats: StepStats, num_local, num_external, sampled) -> dict:
        rewards = [x for g in local for x in g.rewards]
        tokens = sum(len(ids) for s in sampled for ids in s.completion_ids)
        ex_stats = self.exchange.stats
        self.totals.rounds += 1
        self.totals.tokens_generated += tokens
        self.totals.groups_local += len(selection.local)
        self.totals.groups_external += len(selection.external)
        self.totals.dropped_zero_adv += selection.dropped_local + selection.dropped_external
        phase_s = {k: round(v, 4) for k, v in timer.seconds.items()}
        return {
            "round": r,
            "t_start": timer.t0,
            "t_end": time.time(),
            "round_s": round(time.time() - timer.t0, 4),
            "phase_s": phase_s,
            "swarm_io_s": round(phase_s.get("publish", 0.0) + phase_s.get("fetch", 0.0), 4),
            "reward_mean": float(sum(rewards) / len(rewards)) if rewards else 0.0,
            "reward_max": float(max(rewards)) if rewards else 0.0,
            "local_signal_frac": (len(local) - selection.dropped_local) / max(len(local), 1),
            "target_local": num_local,
            "target_external": num_external,
            "num_local": len(selection.local),
            "num_external": len(selection.external),
            "dropped_zero_adv_local": selection.dropped_local,
            "dropped_zero_adv_external": selection.dropped_external,
            "external_available": selection.external_available,
            "external_accepted": ex_stats.round_accepted,
            "external_rejected": sum(ex_stats.round_rejected.values()),
            "rejected_by_reason": dict(ex_stats.round_rejected),
            "verified_batches": ex_stats.round_verified,
            "verify_bytes": ex_stats.round_verify_bytes,
            "verify_s": round(ex_stats.round_verify_s, 4),
            "external_sources": _count_sources(selection.external),
            "loss": stats.loss,
            "kl": stats.kl,
            "clip_frac": stats.clip_frac,
            "ratio_mean": stats.ratio_mean,
            "grad_norm": stats.grad_norm,
            "optimizer_steps": stats.optimizer_steps,
            "tokens_generated": tokens,
            "peak_mem_mb": round(peak_memory_mb(self.device), 1),
            "ij_policy": self.cfg.ij_policy,
            "model": self.cfg.model,  # peers of a mixed swarm run different models (progress view, report)
        }

    def _observation(self, r, selection, record) -> RoundObservation:
        return RoundObservation(
            round=r,
            reward_mean=record["reward_mean"],
            num_local=record["num_local"],
            num_external=record["num_external"],
            external_available=selection.external_available,
            local_signal_frac=record["local_signal_frac"],
            external_signal_frac=record["external_signal_frac"],  # collapse_metrics, already on the record
            external_adv_abs_mean=_mean_abs_adv(selection.external),
            local_adv_abs_mean=_mean_abs_adv(selection.local),
        )

    def _log_round(self, rec: dict) -> None:
        p = rec["phase_s"]
        self.live.history.append({k: rec[k] for k in ("round", "reward_mean", "num_local", "num_external")}
                                 | {"phase_s": p} | {k: rec[k] for k in HISTORY_EXTRA if k in rec})
        del self.live.history[:-500]
        self.live.last_round_at = rec["t_end"]
        log.info(
            "round %d | reward %.3f (max %.2f) | local %d/%d ext %d/%d (avail %d, got %d, rej %d) | dropped %d "
            "| loss %+.4f clip %.3f | gen %.1fs train %.1fs swarm %.2fs",
            rec["round"], rec["reward_mean"], rec["reward_max"], rec["num_local"], rec["target_local"],
            rec["num_external"], rec["target_external"], rec["external_available"], rec["external_accepted"],
            rec["external_rejected"], rec["dropped_zero_adv_local"] + rec["dropped_zero_adv_external"],
            rec["loss"], rec["clip_frac"], p.get("generate", 0), p.get("train", 0), rec["swarm_io_s"],
        )

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe status for /status, /metrics and the dashboard."""
        rewards = [h["reward_mean"] for h in self.live.history]
        ma = rewards[-20:]
        info = self.exchange.identity_info()
        last = self.live.history[-1] if self.live.history else None
        stats = self.exchange.stats
        return {
            **info,
            "swarm": self.cfg.swarm if self.cfg.swarm_enabled else "silo",
            "model": self.cfg.model,
            "version": __version__,
            "round": self.live.round,
            "phase": self.live.phase,
            "uptime_s": time.time() - self.live.started_at,
            "started_at": self.live.started_at,
            "last_reward": rewards[-1] if rewards else None,
            "reward_ma": sum(ma) / len(ma) if ma else None,
            "phase_s": last["phase_s"] if last else {},
            "history": list(self.live.history),
            "peers": dict(stats.peers),
            "groups": stats.to_dict(),
            "reputation": self.exchange.reputation.snapshot(),
            "verify": {"last_round_s": stats.round_verify_s, "last_round_bytes": stats.round_verify_bytes,
                       "last_round_batches": stats.round_verified},
            "totals": vars(self.totals).copy(),
            "last_round_at": self.live.last_round_at,
            "eval": self.live.last_eval,
            "entropy": last.get("entropy_mean") if last else None,
            "signal_frac": last.get("signal_frac") if last else None,
        }


# Learning-health keys kept in the live history (status, dashboard)
HISTORY_EXTRA = ("entropy_mean", "signal_frac", "local_signal_frac", "eval_accuracy")


def _count_sources(groups: list[Group]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g in groups:
        counts[g.source[:16]] = counts.get(g.source[:16], 0) + 1
    return counts


def _mean_abs_adv(groups: list[Group]) -> float:
    values = []
    for g in groups:
        values.extend(abs(a) for a in group_advantages(torch.tensor(g.rewards, dtype=torch.float64)).tolist())
    return sum(values) / len(values) if values else 0.0
