"""The rollout engine as an operator meets it: `sapo-node --rollout-engine llama` samples with llama.cpp when
llama-cpp-python is there, and says in one line that it samples with torch when it is not."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import live_metrics, run_node
from helpers_learning import check_records

ARGS = [
    "--tasks",
    "smoke",
    "--generations",
    "4",
    "--num-local",
    "2",
    "--max-new-tokens",
    "8",
    "--rounds",
    "2",
    "--seed",
    "5",
    "--rollout-engine",
    "llama",
    "--eval-every",
    "0",
    "--no-tensorboard",
]
UNAVAILABLE = "rollout engine llama unavailable"
BINDINGS = ("ik_llama_cpp", "llama_cpp")  # the binary wheel, the source build (node/learn/engines/llama_api.py)


def engine_lines(stderr: str) -> list[str]:
    """The lines that say which rollout engine samples (not the evaluator's line, which names the engine where
    this CPU has no native bf16 and the held-out answers are decoded through it)."""
    return [line for line in stderr.splitlines() if "rollout engine" in line and "held-out evaluation" not in line]


@pytest.mark.slow
def test_a_node_samples_with_the_llama_engine(tmp_path):
    if not any(importlib.util.find_spec(m) for m in BINDINGS):
        pytest.skip("no llama.cpp binding is installed (bash scripts/setup.sh installs the wheel)")
    # SmolLM2's tokenizer on the tiny random Llama: a model llama.cpp can be given (a GGUF vocabulary)
    done = run_node("--model", "tiny-random-smol", *ARGS, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = engine_lines(done.stderr)  # one line names the binding; nothing is unavailable
    assert "sampling with llama" in done.stderr and len(lines) == 1 and "llama.cpp through" in lines[0], lines
    records = live_metrics(tmp_path / "run")
    assert [r["round"] for r in records] == [0, 1] and all(r["tokens_generated"] > 0 for r in records)
    check_records(records)


def test_a_hidden_engine_falls_back_to_torch_in_one_line(tmp_path):
    """llama_cpp made unimportable for the node process (a package of that name that fails to import,
    first on its path): the node says so once, samples with torch, and runs its rounds."""
    for module in BINDINGS:  # the wheel and the source build alike
        hide = tmp_path / "hide" / module
        hide.mkdir(parents=True)
        (hide / "__init__.py").write_text(f'raise ImportError("{module} hidden by the test")\n')
    done = run_node(
        "--model", "tiny-random", *ARGS, "--run-dir", str(tmp_path / "run"), PYTHONPATH=str(tmp_path / "hide")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = engine_lines(done.stderr)
    assert len(lines) == 1 and UNAVAILABLE in lines[0] and "hidden by the test" in lines[0], lines
    assert lines[0].rstrip().endswith("sampling with torch"), lines
    assert "sampling with torch" in done.stderr.split(lines[0])[1]  # the startup line names the engine in use
    assert "Traceback" not in done.stderr
    records = live_metrics(tmp_path / "run")
    assert [r["round"] for r in records] == [0, 1] and all(r["tokens_generated"] > 0 for r in records)
    assert (tmp_path / "run" / "node.log").read_text().count(UNAVAILABLE) == 1
