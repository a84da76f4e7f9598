"""Shared test setup: never touch a model hub; helpers to run the real CLI."""

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import forkserver
from ci_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks: loud skips in CI)
from node.learn.groups import Prompter, local_group, score_responses
from node.learn.model_io import load_model
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import PRESETS, TaskSampler
from p2p.identity import Identity
from p2p.transport import SwarmTransport, TransportConfig
from p2p.wire import TaskSpecWire, WireGroup
from scripts.bench import procs
from scripts.bench.procs import LOOPBACK, NO_EVAL, Proc, node_env

# llama.cpp's bindings (node/learn/engines/llama_api.py): the source build is optional (SAPO_ENGINE=llama-source
# compiles it): its cases exist where it is installed, so a machine without it (CI installs the wheel) has
# nothing to skip
BINDINGS = ["wheel"] + (["source"] if importlib.util.find_spec("llama_cpp") else [])


def need_llama(binding: str) -> None:
    """The wheel is what setup installs by default, so its tests run (a missing wheel fails them) unless
    setup was told otherwise (SAPO_ENGINE=torch or llama-source); the source build is optional. `any`:
    either binding."""
    if binding == "wheel" and os.environ.get("SAPO_ENGINE", "llama") == "llama":
        return
    modules = {"wheel": ["ik_llama_cpp"], "source": ["llama_cpp"], "any": ["ik_llama_cpp", "llama_cpp"]}[binding]
    if not any(importlib.util.find_spec(m) for m in modules):
        pytest.skip(f"no {' or '.join(modules)} here (SAPO_ENGINE={os.environ.get('SAPO_ENGINE')})")


def pytest_collection_modifyitems(config, items):
    """The `slow` tests first on every worker. pytest-xdist's `worksteal` (scripts/test.sh) hands each of its
    k workers one contiguous k-th of this list and lets an idle worker take the tail of a busy one's share: so
    the slow tests are dealt round-robin to the heads of the k shares and the short ones fill the rest. Each
    worker then starts on long end-to-end runs and ends on short tests, which it can share, instead of one
    worker running a 2-minute test alone at the end."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    fast = [item for item in items if item.get_closest_marker("slow") is None]
    shares = [slow[w::workers] for w in range(workers)]
    sizes = [len(items) // workers] * (workers - 1) + [len(items) - (len(items) // workers) * (workers - 1)]
    for share, size in zip(shares, sizes):
        take = max(0, size - len(share))
        share.extend(fast[:take])
        del fast[:take]
    shares[-1].extend(fast)  # whatever a share too full of slow tests left over
    items[:] = [item for share in shares for item in share]


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Nodes and bootstrap peers started by tests mint their keys at a low proof-of-work difficulty (seconds
# at the default on a shared CI core); tests that check the proof of work set their own.
os.environ.setdefault("SAPO_POW_DIFFICULTY", "8")
# The CPU recipe (README "Defaults") changes what an unset flag means on a CPU; tests name what they need
# and run on the paper's defaults otherwise. tests/ops/test_recipe.py checks the recipe itself.
os.environ.setdefault("SAPO_RECIPE", "none")
# Each pytest-xdist worker computes in-process (tests/learn, ...) with its share of the cores: torch's default
# of one thread per core gives 2 workers 4 threads on 2 cores, and the waiting threads spin. Measured on
# tests/learn, 2 workers on 2 cores: 260 s of CPU with 2 threads each, 139 s with 1. Nodes that tests start
# set their own count (SAPO_THREADS in node_env).
TORCH_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(TORCH_THREADS)
forkserver.SERVER_ENV = dict(os.environ)  # the suite's environment, offline, whatever a test patches later
# the swarms' processes start from the preloaded interpreter where it runs
procs.SPAWN = lambda args, cwd, env, out: forkserver.spawn(args, cwd, env, out) if forkserver.usable() else None
# the real-swarm helpers the tests import from here (scripts/bench/procs.py)
live_metrics, prefix_of, stop_all = procs.live_metrics, procs.prefix_of, procs.stop_all
start_bootstrap, start_node = procs.start_bootstrap, procs.start_node

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def newest_checkpoint(run_dir: Path) -> int | None:
    """Round of the newest complete checkpoint directory in a run dir (None if there is none)."""
    rounds = [int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("round-*") if p.is_dir()]
    return max(rounds, default=None)


def run_python(argv: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python *argv` (-m MODULE or -c CODE, from the repo root) to its end, its output captured; started from
    the preloaded interpreter (tests/forkserver.py) where it runs."""
    env = node_env() if env is None else env
    if not forkserver.usable():
        return subprocess.run(
            [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory(prefix="run-python-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = forkserver.spawn(argv, REPO, env, out, err)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(30)
            raise subprocess.TimeoutExpired(
                [sys.executable, *argv], timeout, out.read_bytes(), err.read_bytes()
            ) from None
        return subprocess.CompletedProcess(
            [sys.executable, *argv], child.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def run_node(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """`python -m node.cli ARGS` to its end."""
    return run_python(["-m", "node.cli", *args], timeout, node_env(**env))


def small_silo_node(model, tokenizer, model_name: str, rounds: int, run_dir: Path, *extra: str):
    """A silo node on the smoke tasks, built in this process on a copy of `model`: 2 groups of 3 completions,
    6 new tokens, seed 4, `rounds` rounds; `extra` flags as sapo-node takes them (--eval-every, ...)."""
    import copy

    from node.build import build_node
    from node.ops.config import load_config
    from node.swarm.exchange import Silo

    flags = ["--model", model_name, "--tasks", "smoke", "--num-local", "2", "--generations", "3"]
    flags += ["--max-new-tokens", "6", "--seed", "4", "--rounds", str(rounds), "--run-dir", str(run_dir), *extra]
    cfg = load_config(flags, env={})
    return build_node(cfg, PRESETS["smoke"], copy.deepcopy(model), tokenizer, Silo(), torch.device("cpu"))


@pytest.fixture
def tiny_args():
    """A fast solo configuration on the tiny random model."""
    return [
        "--model",
        "tiny-random",
        "--tasks",
        "smoke",
        "--generations",
        "4",
        "--num-local",
        "2",
        "--max-new-tokens",
        "8",
        "--seed",
        "3",
        *NO_EVAL,
    ]


# ------------------------------------------- real swarms: bootstrap and node subprocesses (scripts/bench/procs.py)

FETCH_TIMEOUT_S = 30.0  # bare transports in tests: see transport()


def sources(records: list[dict]) -> set[str]:
    return {src for r in records for src in r.get("external_sources", {})}


def reasons(records: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in records:
        for reason, n in r.get("rejected_by_reason", {}).items():
            total[reason] = total.get(reason, 0) + n
    return total


def wait_for(pred, procs: list[Proc], timeout: float, what: str, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for p in procs:
            if not p.alive():
                raise AssertionError(
                    f"{p.out.name} exited (rc {p.p.returncode}) while waiting for {what}:\n{p.text()[-3000:]}"
                )
        if time.monotonic() > deadline:
            for p in procs:  # a node prints every thread's stack on SIGUSR1: where it is stuck
                if p.alive() and p.dumps_stacks:
                    p.p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            tails = "\n".join(f"--- {p.out.name} (alive {p.alive()}):\n{p.text()[-2000:]}" for p in procs)
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")
        time.sleep(poll)


async def await_for(pred, timeout: float, what: str, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(poll)


async def stored_eventually(store, what: str, attempts: int = 5) -> None:
    """A valid store came back False once on a loaded CI machine (hivemind reports the verdict of the last
    replica to answer); what is under test is what the honest node does with the record, so retry."""
    for _ in range(attempts):
        if await store():
            return
        await asyncio.sleep(1.0)
    raise AssertionError(f"{what}: valid record not stored after {attempts} attempts")


def smoke_group(seed: int, index_shift: int = 0, claimed=None) -> WireGroup:
    """A correct group for a task of the smoke mix (or with `claimed` rewards instead of the true ones)."""
    task = TaskSampler(PRESETS["smoke"], seed).sample(1 + index_shift)[-1]
    completions = [f"<answer>{task.answer}</answer>", "<answer>certainly not this</answer>"]
    true = score_responses(task, completions)
    assert true[0] != true[1], "the test group needs a learning signal"
    rewards = true if claimed is None else claimed(true)
    return WireGroup(TaskSpecWire(**task.spec.to_wire()), completions, rewards)


def transport(
    tmp: Path, name: str, swarm: str, peers: list[str], identity: Identity | None = None, **kw
) -> SwarmTransport:
    """A bare SwarmTransport on loopback with the test swarm's (low) proof-of-work difficulty, and fetch and
    publish timeouts no loaded machine reaches on loopback: tests compare what a fetch returns with exact
    sets, a fetch returns what it has at its timeout, and a publish cut at its timeout returns False (seen
    once: 5 s passed under four CPU-bound processes on two cores)."""
    kw.setdefault("pow_difficulty", int(os.environ["SAPO_POW_DIFFICULTY"]))
    kw.setdefault("fetch_timeout_s", FETCH_TIMEOUT_S)
    kw.setdefault("publish_timeout_s", FETCH_TIMEOUT_S)
    return SwarmTransport(
        TransportConfig(identity_dir=tmp / name, swarm=swarm, host_maddrs=[LOOPBACK], initial_peers=peers, **kw),
        identity,
    )


def tiny_gemma3(vocab: int, window: int, pad_id: int = 0, tie: bool = True) -> torch.nn.Module:
    """A tiny random Gemma 3: one sliding-window layer (`window` tokens) and one full-attention layer, the
    mix of the real model's cache. Seed torch before calling for fixed weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"],
            pad_token_id=pad_id,
            tie_word_embeddings=tie,
        )
    )


def tiny_signal_groups(seed: int, max_new_tokens: int):
    """The tiny random model and three cpu-easy groups of four completions it sampled, with rewards set so
    every group carries a learning signal (a random model earns nothing): (model, tok, prompter, tasks,
    groups)."""
    torch.manual_seed(0)
    model, tok = load_model("tiny-random", torch.device("cpu"))
    mix = PRESETS["cpu-easy"]
    prompter = Prompter(tok, mix)
    tasks = TaskSampler(mix, seed=seed).sample(3)
    sampled = sample_groups(model, tok, [prompter(t) for t in tasks], 4, SamplingConfig(max_new_tokens=max_new_tokens))
    groups = [local_group(t, s, mix.answer_prefix) for t, s in zip(tasks, sampled)]
    for g in groups:
        g.rewards = [1.0, 0.0, 0.5, 0.0]
    return model, tok, prompter, tasks, groups


def tiny_memory_node(run_dir: Path, *args: str):
    """A real node on the tiny random model over an in-memory swarm of its own: the round loop in-process."""
    from node.build import build_node
    from node.ops.config import load_config
    from node.swarm.memory_exchange import MemoryBoard, MemoryExchange
    from node.swarm.verify import VerifyConfig

    cfg = load_config(
        [
            "--model",
            "tiny-random",
            "--tasks",
            "smoke",
            "--generations",
            "2",
            "--run-dir",
            str(run_dir),
            "--swarm",
            "mem",
            "--no-tensorboard",
            *args,
        ],
        env={},
    )
    model, tok = load_model("tiny-random", torch.device("cpu"))
    exchange = MemoryExchange(MemoryBoard(), Identity.generate(), PRESETS["smoke"], VerifyConfig(swarm="mem"), "tiny")
    return build_node(cfg, PRESETS["smoke"], model, tok, exchange, torch.device("cpu"))
