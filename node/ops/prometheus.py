"""Prometheus text exposition (format 0.0.4) of a node's or the bootstrap's status snapshot.

Pure functions of the snapshot dict, so that /metrics can be tested without a server and junk values
(NaN, strings, missing keys) can never break the exposition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PHASES = ("generate", "score", "publish", "fetch", "verify", "train", "checkpoint", "idle")
# (metric, snapshot key, help) of the flat sections of a snapshot
TOTALS = (
    ("sapo_rounds_total", "rounds", "Rounds completed since start."),
    ("sapo_tokens_generated_total", "tokens_generated", "Completion tokens generated locally."),
    ("sapo_groups_local_total", "groups_local", "Rollout groups generated locally and used for training."),
    ("sapo_groups_external_total", "groups_external", "Rollout groups from other peers used for training."),
    (
        "sapo_dropped_zero_advantage_total",
        "dropped_zero_adv",
        "Rollout groups dropped because all advantages were zero.",
    ),
)
REPUTATION = (
    ("sapo_publishers_tracked", "tracked", "Publishers in this node's reputation table (bounded)."),
    ("sapo_publishers_banned", "banned", "Publishers banned now: neither fetched nor verified."),
)
VERIFY = (
    ("sapo_verify_seconds_last_round", "last_round_s", "Seconds spent verifying received batches in the last round."),
    ("sapo_verify_bytes_last_round", "last_round_bytes", "Bytes of received batches verified in the last round."),
    ("sapo_verify_batches_last_round", "last_round_batches", "Received batches verified in the last round."),
)
NETWORK = (
    ("sapo_network_lag_seconds", "median_age_s", "Median age in seconds of the external groups trained on lately."),
    ("sapo_network_lag_rounds", "median_age_rounds", "Median age in rounds of the external groups trained on lately."),
    ("sapo_network_groups_waiting", "groups_waiting", "Verified external groups waiting for the next select."),
)


def escape_label_value(value: Any) -> str:
    """Escape a label value for the text exposition format (backslash, double quote, newline)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _format_value(value: Any) -> str | None:
    """Format a sample value; None for values that cannot be a sample (skipped, never an error)."""
    if value is None or isinstance(value, (str, bytes, dict, list, tuple)):
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    return repr(f)


class _MetricsWriter:
    def __init__(self) -> None:
        self._families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, name: str, mtype: str, help_text: str, value: Any, labels: Mapping[str, Any] | None = None) -> None:
        formatted = _format_value(value)
        if formatted is None:
            return
        family = self._families.setdefault(name, (mtype, help_text, []))
        if labels:
            label_str = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
            family[2].append(f"{name}{{{label_str}}} {formatted}")
        else:
            family[2].append(f"{name} {formatted}")

    def add_fields(self, mtype: str, source: Any, rows: tuple[tuple[str, str, str], ...]) -> None:
        """One unlabelled sample per (metric, key of `source`, help) row."""
        for name, key, help_text in rows:
            self.add(name, mtype, help_text, num(as_dict(source).get(key)))

    def render(self) -> str:
        out: list[str] = []
        for name, (mtype, help_text, samples) in self._families.items():
            if not samples:
                continue
            out.append(f"# HELP {name} {_escape_help(help_text)}")
            out.append(f"# TYPE {name} {mtype}")
            out.extend(samples)
        return "\n".join(out) + "\n" if out else ""


def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def num(value: Any) -> Any:
    """Numbers pass through; anything else becomes None (skipped)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def render_metrics(snap: Mapping[str, Any], kind: str = "node") -> str:
    """Render a node or bootstrap snapshot as Prometheus text (format 0.0.4).

    Missing or malformed keys are skipped, never an error, so the same renderer serves both the node
    snapshot and the (much smaller) bootstrap snapshot.
    """
    m = _MetricsWriter()
    snap = as_dict(snap)

    info = {"kind": kind}
    for key in ("version", "model", "swarm"):
        if isinstance(snap.get(key), str):
            info[key] = snap[key]
    m.add("sapo_build_info", "gauge", "Build and run information (constant 1).", 1, info)

    m.add("sapo_uptime_seconds", "gauge", "Seconds since the process started.", num(snap.get("uptime_s")))
    m.add(
        "sapo_start_time_seconds",
        "gauge",
        "Start time of the process since the Unix epoch in seconds.",
        num(snap.get("started_at")),
    )
    m.add(
        "sapo_bootstrap_peers_seen",
        "gauge",
        "Number of distinct peers the bootstrap node has seen.",
        num(snap.get("peers_seen")),
    )
    m.add("sapo_round", "gauge", "Current training round.", num(snap.get("round")))

    phase = snap.get("phase")
    if isinstance(phase, str):
        phases = list(PHASES) if phase in PHASES else [*PHASES, phase]
        for p in phases:
            m.add(
                "sapo_phase",
                "gauge",
                "Current phase of the round loop (1 for the active phase).",
                int(p == phase),
                {"phase": p},
            )

    m.add(
        "sapo_reward_last", "gauge", "Mean reward of local completions in the last round.", num(snap.get("last_reward"))
    )
    m.add(
        "sapo_reward_moving_average",
        "gauge",
        "Moving average of the per-round mean reward.",
        num(snap.get("reward_ma")),
    )
    for p, secs in as_dict(snap.get("phase_s")).items():
        m.add(
            "sapo_phase_duration_seconds",
            "gauge",
            "Duration of each phase in the last finished round.",
            num(secs),
            {"phase": p},
        )
    m.add(
        "sapo_last_round_timestamp_seconds",
        "gauge",
        "Unix time at which the last round finished.",
        num(snap.get("last_round_at")),
    )
    learning_health(m, snap)

    m.add_fields("counter", snap.get("totals"), TOTALS)

    membership = as_dict(snap.get("membership"))
    if membership.get("state") in ("joined", "solo"):
        m.add(
            "sapo_swarm_solo",
            "gauge",
            "1 while the node trains solo, waiting for peers (p2p.membership).",
            int(membership["state"] == "solo"),
        )
        if membership["state"] == "solo":
            m.add(
                "sapo_swarm_solo_since_timestamp_seconds",
                "gauge",
                "Unix time since which the node is solo.",
                num(membership.get("since")),
            )

    peers = snap.get("peers")
    if isinstance(peers, dict):
        m.add("sapo_known_peers", "gauge", "Number of peers this node has heard from.", len(peers))
        for key, raw in peers.items():
            info = as_dict(raw)
            if isinstance(info.get("name"), str):
                m.add(
                    "sapo_peer_info",
                    "gauge",
                    "Peer public key to self-reported name (constant 1).",
                    1,
                    {"peer": key, "name": info["name"]},
                )
            m.add(
                "sapo_peer_last_round",
                "gauge",
                "Last round announced by a peer.",
                num(info.get("last_round")),
                {"peer": key},
            )
            m.add(
                "sapo_peer_last_seen_timestamp_seconds",
                "gauge",
                "Unix time a peer was last seen.",
                num(info.get("last_seen")),
                {"peer": key},
            )

    groups = as_dict(snap.get("groups"))
    for key, count in as_dict(groups.get("accepted")).items():
        m.add(
            "sapo_groups_accepted_total",
            "counter",
            "External rollout groups accepted, by peer.",
            num(count),
            {"peer": key},
        )
    for key, reasons in as_dict(groups.get("rejected")).items():
        for reason, count in as_dict(reasons).items():
            m.add(
                "sapo_groups_rejected_total",
                "counter",
                "External rollout groups rejected, by peer and reason.",
                num(count),
                {"peer": key, "reason": reason},
            )

    # reputation: aggregate gauges, and per peer only the bounded table /status lists (label cardinality)
    rep = as_dict(snap.get("reputation"))
    m.add_fields("gauge", rep, REPUTATION)
    for key, raw in as_dict(rep.get("peers")).items():
        info = as_dict(raw)
        m.add(
            "sapo_publisher_score",
            "gauge",
            "Reputation score of the publishers listed in /status (bans, the worst and the best few).",
            num(info.get("score")),
            {"peer": key},
        )
        m.add(
            "sapo_publisher_banned_until_timestamp_seconds",
            "gauge",
            "Unix time at which a listed publisher's ban ends.",
            num(info.get("banned_until")),
            {"peer": key},
        )
    m.add_fields("gauge", snap.get("verify"), VERIFY)
    m.add_fields("gauge", snap.get("network"), NETWORK)

    if "healthy" in snap:
        m.add("sapo_healthy", "gauge", "1 if the node reports itself healthy.", bool(snap.get("healthy")))
    return m.render()


def learning_health(m, snap: dict) -> None:
    """Held-out accuracy (overall and per dataset) and the signs of collapse (entropy, groups with signal)."""
    m.add(
        "sapo_token_entropy",
        "gauge",
        "Mean token entropy (nats) of the last round's sampled completions.",
        num(snap.get("entropy")),
    )
    m.add(
        "sapo_signal_fraction",
        "gauge",
        "Share of the last round's groups whose rewards differ.",
        num(snap.get("signal_frac")),
    )
    ev = as_dict(snap.get("eval"))
    # the in-distribution set, and the unseen one (questions whose content training never draws) where
    # the mix splits by content: absent values are not exported
    for key, what in (("eval", "Held-out"), ("eval_unseen", "Unseen")):
        m.add(
            f"sapo_{key}_accuracy",
            "gauge",
            f"{what} accuracy (greedy) at the last evaluation.",
            num(ev.get(f"{key}_accuracy")),
        )
        for name, value in sorted(ev.items()):
            if name.startswith(f"{key}_accuracy/"):
                m.add(
                    f"sapo_{key}_accuracy_by_dataset",
                    "gauge",
                    f"{what} accuracy at the last evaluation, by dataset.",
                    num(value),
                    {"dataset": name.split("/", 1)[1]},
                )
        m.add(
            f"sapo_{key}_constant_baseline",
            "gauge",
            "Accuracy of one fixed answer per dataset on the "
            f"{what.lower()} evaluation set: a collapsed policy scores about this.",
            num(ev.get(f"{key}_baseline")),
        )
    m.add("sapo_eval_round", "gauge", "Round of the last held-out evaluation.", num(ev.get("round")))
    m.add(
        "sapo_eval_duration_seconds",
        "gauge",
        "Seconds the last held-out evaluation took (0: it repeated an earlier result, the weights unchanged).",
        num(ev.get("eval_s")),
    )
    guard = as_dict(snap.get("guard"))
    m.add(
        "sapo_guard_restores_total",
        "counter",
        "Times the collapse guard restored the best evaluation's weights.",
        num(guard.get("restores")),
    )
    m.add(
        "sapo_learning_rate",
        "gauge",
        "The learning rate of the last round (the collapse guard lowers it).",
        num(guard.get("lr")),
    )
