#!/usr/bin/env python
"""Behaviour check for refactors: the same fixed run before and after a change must learn the same.

Runs the real `sapo-node` CLI, one thread, with fixed flags (tiny random model, smoke tasks, full
fine-tuning, torch sampler, no KL, fixed seed, silo, held-out evaluation every round) in a temporary
run dir, twice: 3 rounds straight, and 2 rounds then --resume to 3 (so checkpoint and resume take part).
It writes what the node learned per round (rewards, losses, held-out figures; never timings) and its last
checkpoint (digests of weights and optimizer state, the loop's RNG and sampler state, the manifest's meta)
as JSON.

    python scripts/check_equivalence.py --out now.json                      # this checkout
    python scripts/check_equivalence.py --rev 5a5ab9c --out ref.json        # a commit, from a temporary worktree
    python scripts/check_equivalence.py --compare docs/data/equivalence/reference-5a5ab9c.json

With --compare the run is checked against a reference and any difference is printed (exit 1). The
figures are bit-exact on one machine; another CPU (other kernels, other bf16 support) may differ, so a
reference taken elsewhere is best re-taken there with --rev.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 3
RESUME_AFTER = 2
FLAGS = [
    "--model",
    "tiny-random",
    "--tasks",
    "smoke",
    "--rollout-engine",
    "torch",
    "--beta",
    "0",
    "--lora-rank",
    "0",
    "--lr",
    "1e-3",
    "--generations",
    "4",
    "--num-local",
    "4",
    "--num-external",
    "0",
    "--max-new-tokens",
    "12",
    "--eval-every",
    "1",
    "--eval-size",
    "16",
    "--seed",
    "3",
    "--threads",
    "1",
    "--mixed-precision",
    "off",
    "--checkpoint-every",
    "1",
    "--ij-policy",
    "fixed",
    "--no-tensorboard",
]
# what the node learned each round; timings, dates and memory are left out (they differ run to run)
KEYS = (
    "round",
    "reward_mean",
    "reward_max",
    "loss",
    "kl",
    "clip_frac",
    "grad_norm",
    "ratio_mean",
    "optimizer_steps",
    "tokens_generated",
    "num_local",
    "num_external",
    "target_local",
    "target_external",
    "dropped_zero_adv_local",
    "dropped_zero_adv_external",
    "local_signal_frac",
    "entropy_mean",
    "signal_frac",
    "eval_accuracy",
    "eval_baseline",
    "eval_size",
    "eval_scores",
    "eval_answers",
)
PREFIXES = ("eval_accuracy/", "eval_baseline/")  # per dataset


def node_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAPO_")}  # only FLAGS configure the run
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        SAPO_POW_DIFFICULTY="0",
        SAPO_COLLAPSE_GUARD="false",
    )  # the collapse guard off; code from before it ignores the variable
    return env


def run_node(repo: Path, run_dir: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "node.cli", *FLAGS, "--run-dir", str(run_dir), *extra]
    proc = subprocess.run(cmd, cwd=repo, env=node_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"sapo-node failed in {repo} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def learned(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k in KEYS or k.startswith(PREFIXES)} for row in rows]


def digest(value: Any, h: hashlib._Hash | None = None) -> str:
    """sha256 over a (nested) state dict's keys and tensor bytes, in a fixed order."""
    import torch

    top = h is None
    h = h or hashlib.sha256()
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(repr(key).encode())
            digest(value[key], h)
    elif isinstance(value, (list, tuple)):
        for item in value:
            digest(item, h)
    elif isinstance(value, torch.Tensor):
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())
    return h.hexdigest() if top else ""


def last_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The newest checkpoint: digests of weights, optimizer and loop state (RNG streams, sampler, I/J policy,
    totals; without the config, which names the temporary run dir), the manifest's meta (which weights they
    belong to)."""
    import torch

    path = max((run_dir / "checkpoints").glob("round-*"))
    state = json.loads((path / "state.json").read_text())
    state.pop("config", None)
    state.pop("version", None)
    state.pop("guard", None)  # the collapse guard's state (off here), added after the reference was taken
    return {
        "name": path.name,
        "weights_sha256": digest(torch.load(path / "model.pt", map_location="cpu", weights_only=True)),
        "optimizer_sha256": digest(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)),
        "state_sha256": hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest(),
        "next_round": state.get("next_round"),
        "totals": state.get("totals"),
        "ij_policy": state.get("ij_policy"),
        "meta": json.loads((path / "MANIFEST.json").read_text()).get("meta"),
    }


def measure(repo: Path) -> dict[str, Any]:
    """The two runs of the checkout at `repo`, as JSON-safe figures."""
    with tempfile.TemporaryDirectory(prefix="sapo-equiv-") as tmp:
        straight, resumed = Path(tmp) / "straight", Path(tmp) / "resumed"
        run_node(repo, straight, "--rounds", str(ROUNDS))
        run_node(repo, resumed, "--rounds", str(RESUME_AFTER))
        run_node(repo, resumed, "--rounds", str(ROUNDS), "--resume")
        return {
            "flags": FLAGS,
            "straight": learned(straight),
            "resumed": learned(resumed),
            "checkpoint": {"straight": last_checkpoint(straight), "resumed": last_checkpoint(resumed)},
        }


def measure_rev(rev: str) -> dict[str, Any]:
    """The same figures for another commit, from a temporary git worktree of it."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="sapo-equiv-rev-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True, capture_output=True
        )
        try:
            return {"rev": commit, **measure(tree)}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


def differences(ref: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    if ref.get("flags") != now.get("flags"):
        out.append(f"flags differ: {ref.get('flags')} vs {now.get('flags')}")
    for run in ("straight", "resumed"):
        a, b = ref.get(run, []), now.get(run, [])
        if len(a) != len(b):
            out.append(f"{run}: {len(a)} rounds in the reference, {len(b)} now")
        for ra, rb in zip(a, b):
            for key in sorted(set(ra) | set(rb)):
                if ra.get(key, "<missing>") != rb.get(key, "<missing>"):
                    out.append(
                        f"{run} round {ra.get('round')}: {key}: {ra.get(key, '<missing>')!r} "
                        f"-> {rb.get(key, '<missing>')!r}"
                    )
    for run, ca in ref.get("checkpoint", {}).items():
        cb = now.get("checkpoint", {}).get(run, {})
        for key in sorted(set(ca) | set(cb)):
            if ca.get(key) != cb.get(key):
                out.append(f"{run} checkpoint: {key} differs: {ca.get(key)!r:.300} -> {cb.get(key)!r:.300}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="measure this commit (a temporary git worktree) instead of this checkout")
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--compare", help="reference JSON: exit 1 and print every difference")
    args = parser.parse_args(argv)
    now = measure_rev(args.rev) if args.rev else {"rev": "checkout", **measure(REPO)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(now, indent=1) + "\n")
    if args.compare:
        ref = json.loads(Path(args.compare).read_text())
        diffs = differences(ref, now)
        if diffs:
            print(f"{len(diffs)} difference(s) from {args.compare} (rev {ref.get('rev')}):")
            print("\n".join(f"  {d}" for d in diffs))
            return 1
        print(
            f"identical to {args.compare} (rev {ref.get('rev')}): {len(now['straight'])} rounds straight, "
            f"{len(now['resumed'])} with a resume"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
