"""`sapo-experiment` with peers that differ: a model per peer (`--models`) and flags per peer (`--peer-arg`),
e.g. a veteran started from a trained adapter beside a fresh newcomer, in memory mode on shared bases."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import live_metrics, run_python
from node.lab.experiment import build_parser, main, plan_runs
from node.lab.runspec import RunSpec, node_learning_settings, parse_peer_args, recipe_env, unused_settings
from node.ops.checkpoint import CheckpointStore
from node.ops.config import load_config
from p2p.identity import KEY_FILENAME, Identity

FAST = [
    "--tasks",
    "smoke",
    "--generations",
    "4",
    "--max-new-tokens",
    "8",
    "--threads",
    "1",
    "--mode",
    "memory",
    "--eval-every",
    "0",
    "--keep-run-checkpoints",
    "--node-arg=--pow-difficulty=8",
    "--node-arg=--rollout-engine=torch",
]


def experiment(*args: str) -> subprocess.CompletedProcess:
    done = run_python(["-m", "node.lab.experiment", *args, *FAST], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def spec(**kw) -> RunSpec:
    base = dict(
        config_name="2/2",
        seed=3,
        peers=3,
        num_local=2,
        num_external=2,
        generations=4,
        ij_policy="fixed",
        rounds=5,
        model="default",
        tasks="smoke",
        max_new_tokens=0,
        lr=1e-4,
        mode="dht",
        threads=1,
    )
    return RunSpec(**{**base, **kw})


def flag(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def test_each_peer_gets_its_model_and_its_own_flags_last():
    s = spec(
        models=["default", "gemma3-270m", "default"],
        extra_args=["--eval-every=10"],
        peer_args=parse_peer_args(["1:--eval-every=5", "1:--lora-init=/v/a", "2:--beta=0.04"], 3),
    )
    args = [s.node_args(p, Path(f"/r/peer{p}")) for p in range(3)]
    assert [flag(a, "--model") for a in args] == [["default"], ["gemma3-270m"], ["default"]]
    assert [flag(a, "--seed") for a in args] == [["3000"], ["3001"], ["3002"]]
    assert args[0][-1] == "--eval-every=10"  # the common flag alone
    assert args[1][-3:] == ["--eval-every=10", "--eval-every=5", "--lora-init=/v/a"]  # its own after: they win
    assert args[2][-1] == "--beta=0.04" and "--lora-init=/v/a" not in args[2]
    assert flag(spec().node_args(0, Path("/r")), "--lora-rank") == ["0"]  # said, so no node recipe picks one


def test_each_peer_can_practise_its_own_part(tmp_path):
    """Specialists: `--peer-arg P:--practise=DATASET` gives each peer its own part of the run's one mix (run.json
    keeps it, in peer_args); what a peer accepts from the others stays the whole mix."""
    parts = ["propositional_logic", "palindrome_generation:2"]
    argv = ["2/2", "--peers", "2", "--seeds", "0", "--out", str(tmp_path), *FAST]
    args = build_parser().parse_args(argv + [f"--peer-arg={p}:--practise={part}" for p, part in enumerate(parts)])
    [(_, run)] = plan_runs(args)
    assert run.peer_args == {0: ["--practise=propositional_logic"], 1: ["--practise=palindrome_generation:2"]}
    cfgs = [load_config(run.node_args(p, tmp_path / f"peer{p}"), env=recipe_env()) for p in range(2)]
    assert [(c.tasks, c.practise) for c in cfgs] == [("smoke", "propositional_logic"), ("smoke", parts[1])]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "recipe, argv, expected",
    [
        (None, [], ("cpu-learn", 8, 2e-4)),  # a CPU: the CPU recipe, as sapo-node alone (conftest says none)
        (None, ["--lora-rank", "0"], ("cpu-learn", 0, 1e-6)),  # full fine-tuning asked for: its own rate
        (None, ["--tasks", "smoke", "--lr", "1e-4"], ("smoke", 8, 1e-4)),
        (None, ["--node-arg=--recipe=none"], ("paper", 0, 1e-6)),
        ("none", [], ("paper", 0, 1e-6)),
    ],
)
def test_unset_learning_settings_are_the_nodes_own(monkeypatch, recipe, argv, expected):
    """What no flag of the experiment sets, its peers get as `sapo-node` would choose it: on a CPU its recipe, not
    a mix and a rate that leave a small model nothing to learn."""
    monkeypatch.delenv("SAPO_RECIPE", raising=False)
    if recipe:
        monkeypatch.setenv("SAPO_RECIPE", recipe)
    monkeypatch.setenv("SAPO_TASKS", "smoke")  # the node's other environment is not the experiment's
    args = build_parser().parse_args(["2/2", *argv])
    assert node_learning_settings(args, ["default"]) == expected


def test_a_peer_resolves_the_recipe_the_experiment_planned_with(monkeypatch):
    """SAPO_RECIPE=none with LoRA: the plan has the paper's mix; a memory-mode peer, reading its flags with the
    experiment's recipe environment, has that recipe and its beta 0, not the CPU recipe's 0.04."""
    monkeypatch.setenv("SAPO_RECIPE", "none")
    args = build_parser().parse_args(["2/2", "--lora-rank", "8"])
    tasks, rank, lr = node_learning_settings(args, ["default"])
    flags = spec(tasks=tasks, lora_rank=rank, lr=lr).node_args(0, Path("/r/peer0"))
    cfg = load_config(flags, env=recipe_env())
    assert (cfg.recipe, cfg.tasks, cfg.beta) == ("none", "paper", 0.0)
    assert load_config(flags, env={}).beta == 0.04  # what an empty environment would have given it


def test_models_whose_recipes_differ_need_one_named(monkeypatch):
    """On a GPU the packaged model takes the CPU recipe and another model the paper's: one run, one recipe."""
    monkeypatch.delenv("SAPO_RECIPE", raising=False)
    mixed = ["default", "Qwen/Qwen2.5-0.5B-Instruct"]
    args = build_parser().parse_args(["2/2", "--node-arg=--device=cuda"])
    with pytest.raises(ValueError, match="recipes differ here .default: cpu, Qwen/Qwen2.5-0.5B-Instruct: none"):
        node_learning_settings(args, mixed)
    args = build_parser().parse_args(["2/2", "--node-arg=--device=cuda", "--node-arg=--recipe=cpu"])
    assert node_learning_settings(args, mixed) == ("cpu-learn", 8, 2e-4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--node-arg=--no-such-flag"], "--no-such-flag is no sapo-node flag"),
        (["--node-arg=--recipe=fast"], "--recipe must be one of"),
        (["--node-arg=--beta=abc"], "--node-arg: a value sapo-node refuses"),
        (["--generations", "48"], "--generations must be <= 32 in a swarm"),  # every group would be left out
        (["--peer-arg", "1:--generations=48"], "--peer-arg 1: --generations must be <= 32 in a swarm"),
        (["--peer-arg", "1:--no-such-flag"], "--peer-arg 1: --no-such-flag is no sapo-node flag"),
        (["--peer-arg", "5:--beta=0.1"], "peer 5 does not exist (peers 0..4)"),
        (["--peer-arg", "x:--beta=0.1"], "expected PEER:FLAG"),
        (["--peer-arg", "1:beta"], "expected PEER:FLAG"),
        (["--models", "default,tiny-random", "--peer-arg", "2:--beta=0.1"], "peer 2 does not exist (peers 0..1)"),
        (["--models", "default,tiny-random", "--peers", "3"], "names 2 models but --peers is 3"),
        (["--models", "default,,tiny-random"], "an empty model name"),
        (
            ["--tasks", "smoke", "--peer-arg", "1:--practise=chain_sum"],
            "--peer-arg 1: --practise chain_sum: not in the task mix smoke",
        ),
        (["--tasks", "smoke", "--node-arg=--practise=chain_sum"], "error: --practise chain_sum: not in the task mix"),
        (["--peer-arg", "0:--practise=chain_sum:0"], "--peer-arg 0: --practise needs a positive weight"),
    ],
)
def test_bad_per_peer_options_are_refused_before_anything_runs(tmp_path, capsys, argv, message):
    assert main(["2/2", "--out", str(tmp_path / "exp"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "exp").exists()


def test_an_interrupted_run_resumes_only_with_its_own_settings(tmp_path, caplog, monkeypatch):
    """Resuming with another learning rate would mix two recipes in one run whose run.json names the second;
    and a run dir has one runner at a time."""
    monkeypatch.setattr("signal.signal", lambda *a: None)  # main's handlers stay out of the test process
    run = tmp_path / "exp" / "2-2" / "seed0"
    run.mkdir(parents=True)
    saved = {"config_name": "2/2", "seed": 0, "lr": 0.5, "rounds": 3, "status": "interrupted"}
    (run / "run.json").write_text(json.dumps(saved))
    argv = ["2/2", "--out", str(tmp_path / "exp"), "--seeds", "0", "--rounds", "5", "--lr", "0.001", *FAST]
    assert main(argv) == 2
    assert "lr 0.5 -> 0.001" in caplog.text and "rounds" not in caplog.text.split("other settings")[1]
    assert json.loads((run / "run.json").read_text()) == saved  # untouched
    assert (run / "node.lock").read_text().strip() == str(os.getpid())  # the runner's lock (tests/ops/test_runlock)


@pytest.mark.slow
def test_a_mixed_swarm_in_memory_one_base_per_model(tmp_path):
    """Two models with different tokenizers, one shared base each; the peers train on each other's groups."""
    exp = tmp_path / "exp"
    done = experiment(
        "2/2",
        "--out",
        str(exp),
        "--models",
        "tiny-random-smol,tiny-random,tiny-random-smol",
        "--seeds",
        "0",
        "--rounds",
        "2",
        "--lora-rank",
        "2",
    )
    assert "2 peers share one base model, each with its own rank-2 LoRA adapter" in done.stderr
    assert "1 peers share one base model" in done.stderr
    run = exp / "2-2" / "seed0"
    meta = json.loads((run / "run.json").read_text())
    assert meta["models"] == ["tiny-random-smol", "tiny-random", "tiny-random-smol"] and meta["peers"] == 3
    assert meta["model"] == "mixed"
    manifests = [
        json.loads(next((run / f"peer{p}" / "checkpoints").glob("round-*/MANIFEST.json")).read_text()) for p in range(3)
    ]
    assert [m["meta"]["model"] for m in manifests] == meta["models"]
    bases = [m["meta"]["base"] for m in manifests]
    assert bases[0] == bases[2] != bases[1]
    other = Identity.load_or_create(run / "peer1" / KEY_FILENAME, create=False).public_key_hex[:16]
    assert {r["publisher"] for r in live_metrics(run / "peer1")} == {other}  # how its records name it
    trained_on = [src for p in (0, 2) for r in live_metrics(run / f"peer{p}") for src in r["external_sources"]]
    assert other in trained_on, trained_on  # the first family trained on the second family's groups


@pytest.mark.slow
def test_a_veteran_starts_from_a_trained_adapter_beside_a_fresh_peer(tmp_path):
    """A solo run writes an adapter; a second experiment starts its peer 1 from it (--peer-arg) on the shared
    base. Seeds differ everywhere (source node seed 5000, peers 0 and 1), so equal weights come from the
    checkpoint only; lr 1e-12 keeps one round from moving them."""
    source = tmp_path / "solo"
    experiment(
        "4/0",
        "--out",
        str(source),
        "--model",
        "tiny-random",
        "--peers",
        "1",
        "--seeds",
        "5",
        "--rounds",
        "1",
        "--lora-rank",
        "2",
        "--lr",
        "1e-2",
    )
    adapter_dir = source / "4-0" / "seed5" / "peer0"
    exp = tmp_path / "exp"
    done = experiment(
        "2/2",
        "--out",
        str(exp),
        "--model",
        "tiny-random",
        "--peers",
        "2",
        "--seeds",
        "0",
        "--rounds",
        "1",
        "--lora-rank",
        "2",
        "--lr",
        "1e-12",
        "--peer-arg",
        f"1:--lora-init={adapter_dir}",
    )
    assert "adapter initialised from" in done.stderr
    run = exp / "2-2" / "seed0"
    assert json.loads((run / "run.json").read_text())["peer_args"] == {"1": [f"--lora-init={adapter_dir}"]}
    theirs = CheckpointStore(adapter_dir).load_latest().model
    veteran, newcomer = (CheckpointStore(run / f"peer{p}").load_latest().model for p in (1, 0))
    assert set(theirs) == set(veteran) == set(newcomer)
    assert all(torch.allclose(theirs[k], veteran[k], atol=1e-6) for k in theirs)
    lora_a = [k for k in theirs if ".lora_A." in k]
    assert lora_a and not any(torch.allclose(theirs[k], newcomer[k], atol=1e-3) for k in lora_a)


def test_a_dht_peer_sees_the_settings_a_memory_peer_sees(monkeypatch):
    """A shell's SAPO_<OPTION> reaches neither mode's peers (dht-mode peers used to read it, memory-mode ones
    not, and run.json recorded it for neither); the recipe, the swarm's key minting and what is not a
    sapo-node setting (the model cache) pass."""
    from node.lab.plan import peer_env

    for key, value in {
        "SAPO_EVAL_EVERY": "0",
        "SAPO_CONFIG": "/elsewhere.toml",
        "SAPO_RECIPE": "cpu",
        "SAPO_POW_DIFFICULTY": "8",
        "SAPO_MODEL_CACHE": "/cache",
    }.items():
        monkeypatch.setenv(key, value)
    env = peer_env(spec(threads=2))
    assert "SAPO_EVAL_EVERY" not in env and "SAPO_CONFIG" not in env
    assert (env["SAPO_RECIPE"], env["SAPO_POW_DIFFICULTY"], env["SAPO_MODEL_CACHE"]) == ("cpu", "8", "/cache")
    assert env["SAPO_THREADS"] == "2"
    # SAPO_PEERS: local_swarm.sh's peer count, the experiment's --peers; SAPO_THREADS: set by its --threads
    assert unused_settings(env | {"SAPO_EVAL_EVERY": "0", "SAPO_PEERS": "5"}) == ["SAPO_EVAL_EVERY", "SAPO_PEERS"]
