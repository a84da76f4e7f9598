"""Committed experiment cells made by hand, for the tools that read docs/data/<experiment>/."""

import json
from pathlib import Path


def committed_cell(data: Path, config: str, seed: int, curve: list[float]) -> None:
    """A committed cell of one peer evaluated at rounds 0, 5, 10, ... with these held-out accuracies."""
    run = data / config.replace("/", "-").replace(" ", "-") / f"seed{seed}"
    (run / "peer0").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"config_name": config, "seed": seed, "status": "complete"}))
    rows = [{"round": 5 * i, "reward_mean": 0.0, "eval_accuracy": a} for i, a in enumerate(curve)]
    (run / "peer0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
