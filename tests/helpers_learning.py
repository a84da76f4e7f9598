"""Shared by the tests of learning and evaluation: scripted policies that answer through the real
evaluation path (prompt, greedy decoding, answer extraction, scoring) without a trained model."""

from __future__ import annotations

from collections.abc import Callable

import torch

from node.learn.tasks import Task


class ScriptedPolicy(torch.nn.Module):
    """A "model" whose greedy completion of a prompt is `respond(task)`, for the task whose question the
    prompt holds. It has no KV cache (the evaluation then pads every batch itself) and one parameter (the
    evaluation reads the device from it)."""

    def __init__(self, tokenizer, tasks: list[Task], respond: Callable[[Task], str]):
        super().__init__()
        self.tokenizer, self.respond = tokenizer, respond
        self.tasks = sorted(tasks, key=lambda t: len(t.question), reverse=True)  # longest question first
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.calls = 0

    def forward(self, *args, **kwargs):
        raise TypeError("a scripted policy has no forward pass (and so no KV cache)")

    def task_of(self, prompt: str) -> Task:
        found = [t for t in self.tasks if t.question in prompt]
        assert found, f"no task's question in the prompt {prompt[-200:]!r}"
        return found[0]

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_) -> torch.Tensor:
        self.calls += 1
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tokenizer.decode([i for i, m in zip(ids, mask) if m])
            answer = self.tokenizer(self.respond(self.task_of(prompt)), add_special_tokens=False)["input_ids"]
            rows.append(answer + [self.tokenizer.eos_token_id])
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        new = torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=input_ids.dtype)
        return torch.cat([input_ids, new], dim=1)


def check_records(records: list[dict]) -> None:
    """What every round record of metrics.jsonl must satisfy, whatever the run: a node never trains on
    more groups than the I and J it chose for the round, nor on more external groups than it had, nor on
    one external group twice (across its restarts too: `records` is a run dir's metrics.jsonl)."""
    for r in records:
        where = f"round {r.get('round')}"
        assert 0 <= r["num_local"] <= r["target_local"], (where, r["num_local"], r["target_local"])
        assert 0 <= r["num_external"] <= r["target_external"], (where, r["num_external"], r["target_external"])
        assert r["num_external"] <= r["external_available"], (where, r["num_external"], r["external_available"])
        assert sum(r["external_sources"].values()) == r["num_external"], where
        assert len(r["external_groups"]) == r["num_external"], where
        assert all(g.split("/")[0] in r["external_sources"] for g in r["external_groups"]), where
    trained = [g for r in records for g in r["external_groups"]]
    assert len(trained) == len(set(trained)), sorted(g for g in set(trained) if trained.count(g) > 1)
