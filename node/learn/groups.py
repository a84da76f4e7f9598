"""Rollout groups, local and external, and how I local + J external groups are chosen for training."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from node.learn.grpo import group_advantages, has_signal, keeps_external, weighs_external
from node.learn.sampling import SampledGroup, Sequence, encode_completion, prompt_text
from node.learn.screen import ExternalScreen
from node.learn.tasks import Task, TaskMix, build_messages, score_responses

LOCAL = "local"
log = logging.getLogger("sapo.node")


def external_token_cap(max_new_tokens: int) -> int:
    """How many of our tokens of one external completion are trained on. The wire caps characters (8000), not
    tokens: one such text can be 32,000 tokens of ours, and one row of logits for it several GB. A generous
    multiple of our own generation length: another tokenizer, or a peer that generates longer, stays whole."""
    return max(4 * max_new_tokens, 256)


@dataclass
class Group:
    """A task and G full assistant responses, scored by *this* node's reward function."""

    task: Task
    responses: list[str]  # full assistant text, forced answer prefix included
    rewards: list[float]
    source: str = LOCAL  # "local" or the publisher's public key (hex)
    sampled: SampledGroup | None = None  # token ids and behaviour log-probs, local groups only
    sender_rewards: list[float] = field(default_factory=list)  # informational, never trusted
    # external groups: the publisher's mean token log-prob of each completion (mu), if it sent them. A lie can
    # only lower the weight of its own completions (node/learn/grpo.py): never trusted beyond that
    behaviour_mean_logp: list[float] | None = None
    # external groups: when the publisher signed its batch (its clock), and our round at whose start the fetch
    # that brought it began (node/swarm/pipeline.py): the group's age when it is trained on (records)
    created_at: float | None = None
    fetch_round: int | None = None

    def signal(self) -> bool:
        return has_signal(self.rewards)

    def mean_behaviour_logp(self) -> list[float] | None:
        """Per completion, the mean log-prob of its tokens under the policy that sampled it (ours, for a
        local group), as published for peers that weigh our completions (--external-loss is/ftis)."""
        if self.sampled is None:
            return None
        return [sum(lp) / len(lp) if lp else 0.0 for lp in self.sampled.behaviour_logp]


def right_and_wrong(rewards: list[float]) -> bool:
    """Whether a group holds a fully right and a not fully right completion: what the task surveys count as a
    group with a learning signal (the zero-advantage filter keeps any group whose rewards differ)."""
    return any(r >= 1.0 for r in rewards) and any(r < 1.0 for r in rewards)


def local_group(task: Task, sampled: SampledGroup, answer_prefix: str) -> Group:
    responses = [answer_prefix + text for text in sampled.texts]
    return Group(task=task, responses=responses, rewards=score_responses(task, responses), sampled=sampled)


@dataclass
class Selection:
    """What a round trains on (`local`, `external`) out of the groups on offer, and how many of those had signal."""

    local: list[Group]
    external: list[Group]
    dropped_local: int  # zero-advantage groups dropped
    dropped_external: int
    local_available: int  # local groups with signal
    external_available: int  # external groups with signal to sample from

    @property
    def local_signal_frac(self) -> float:
        """The share of our own groups whose rewards differ (0 when we sampled none)."""
        return self.local_available / max(self.local_available + self.dropped_local, 1)

    @property
    def external_signal_frac(self) -> float:
        """The share of the verified external groups whose rewards differ (0 when none came)."""
        offered = self.external_available + self.dropped_external
        return self.external_available / offered if offered else 0.0


def select_groups(
    local: list[Group], external: list[Group], num_local: int, num_external: int, rng: random.Random
) -> Selection:
    """Drop zero-advantage groups, keep up to I local ones, sample J external ones uniformly (seeded)."""
    useful_local = [g for g in local if g.signal()]
    useful_external = [g for g in external if g.signal()]
    chosen_external = rng.sample(useful_external, min(num_external, len(useful_external)))
    return Selection(
        local=useful_local[:num_local],
        external=chosen_external,
        dropped_local=len(local) - len(useful_local),
        dropped_external=len(external) - len(useful_external),
        local_available=len(useful_local),
        external_available=len(useful_external),
    )


def mean_reward(groups: list[Group]) -> float:
    """The mean reward over every completion of `groups` (0 for none)."""
    rewards = [x for g in groups for x in g.rewards]
    return float(sum(rewards) / len(rewards)) if rewards else 0.0


def mean_abs_advantage(groups: list[Group]) -> float:
    """The mean |group-relative advantage| over every completion of `groups` (0 for none)."""
    values: list[float] = []
    for g in groups:
        values.extend(abs(a) for a in group_advantages(torch.tensor(g.rewards, dtype=torch.float64)).tolist())
    return sum(values) / len(values) if values else 0.0


def to_sequences(
    groups: list[Group],
    tokenizer,
    prompt_for,
    scale_std: bool,
    external_loss: str = "sapo",
    max_external_tokens: int | None = None,
    screen: ExternalScreen | None = None,
) -> list[Sequence]:
    """Training sequences with group-relative advantages.

    Local groups keep their sampled token ids and behaviour log-probs (when exact: sampled by the trained
    model itself). External groups are re-encoded with our tokenizer and chat template; their pi_old, like
    that of a rollout engine's samples, is formed by the trainer with our own model. `external_loss` says
    which external completions enter the update and with what weight (node/learn/grpo.py): the advantages
    are always those of the whole group. An external completion longer than `max_external_tokens` of ours is
    trained on its first that many (without the EOS it never reached), and the cut is logged. `screen`
    (--external-screen) shapes every external completion with positive advantage, the only ones whose text
    the update would teach: tokens outside the answer span out of the loss, or the completion dropped, and
    the rest marked for the trainer's reference screen (node/learn/screen.py).
    """
    seqs: list[Sequence] = []
    cut = 0
    screening = screen is not None and screen.active
    if screen is not None:
        screen.begin()
    for g in groups:
        adv = group_advantages(torch.tensor(g.rewards, dtype=torch.float64), scale_std=scale_std).tolist()
        if g.sampled is not None:
            exact = g.sampled.logp_exact
            for ids, lp, a in zip(g.sampled.completion_ids, g.sampled.behaviour_logp, adv):
                if ids:
                    seqs.append(Sequence(g.sampled.prompt_ids, ids, a, lp if exact else None))
            continue
        prompt = prompt_for(g.task)
        prefix = prompt_for.answer_prefix
        mu = g.behaviour_mean_logp if weighs_external(external_loss) else None
        for i, (response, a) in enumerate(zip(g.responses, adv)):
            if not keeps_external(external_loss, a, mu is not None):
                continue
            body = response[len(prefix) :] if prefix and response.startswith(prefix) else response
            prompt_ids, completion_ids = encode_completion(tokenizer, prompt, body)
            weights = None
            if screening and a > 0:
                assert screen is not None
                weights = screen.shape(tokenizer, g.task, body, completion_ids, prefix, g.source[:16])
                if weights is False:
                    continue
            if max_external_tokens is not None and len(completion_ids) > max_external_tokens:
                completion_ids = completion_ids[:max_external_tokens]
                cut += 1
            seq = Sequence(prompt_ids, completion_ids, a, behaviour_mean_logp=None if mu is None else mu[i])
            seq.source, seq.screened = g.source, screening and a > 0
            seq.token_weights = weights[: len(completion_ids)] if isinstance(weights, list) else None
            seqs.append(seq)
    if cut:
        log.warning("%d external completions cut to their first %d tokens for training", cut, max_external_tokens)
    return seqs


class Prompter:
    """This node's prompt for a task: chat template + system prompt + forced answer prefix."""

    def __init__(self, tokenizer, mix: TaskMix):
        self.tokenizer = tokenizer
        self.mix = mix
        self.answer_prefix = mix.answer_prefix

    def __call__(self, task: Task) -> str:
        return prompt_text(self.tokenizer, build_messages(self.mix, task), self.answer_prefix)


def collapse_metrics(local: list[Group], external: list[Group]) -> dict[str, float]:
    """Signs of a collapsing policy, per round: the sampled completions' mean token entropy (token
    weighted, from the sampling logits) and the share of all groups on offer, local and external, whose
    rewards differ (only those teach anything; when it nears 0 learning stops)."""
    tokens = entropy_sum = 0.0
    for g in local:
        if g.sampled is not None:
            for ids, h in zip(g.sampled.completion_ids, g.sampled.entropy):
                tokens += len(ids)
                entropy_sum += h * len(ids)
    groups = local + external
    return {
        "entropy_mean": entropy_sum / tokens if tokens else 0.0,
        "signal_frac": sum(g.signal() for g in groups) / len(groups) if groups else 0.0,
        "external_signal_frac": sum(g.signal() for g in external) / len(external) if external else 0.0,
    }
