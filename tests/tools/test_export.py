"""sapo-export and sapo-ask on real runs of the real `sapo-node` CLI.

The default model after a short LoRA run: the hf export's greedy answers on the held-out set are the node's
own evaluation of that checkpoint, answer for answer (both torch in fp32), the peft export's too, the gguf
export loads in the llama.cpp wheel and answers within the engine's parity bound (docs/EVALUATION.md), and
`sapo-ask --eval` on the export gives the node's figure. A full fine-tune and the Gemma family export too; a
bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import need_llama, run_node, run_python
from node.learn.evaluate import evaluate
from node.learn.groups import Prompter
from node.learn.packaged import is_installed
from node.learn.tasks import eval_tasks, resolve_mix
from node.ops.checkpoint import CheckpointStore
from node.ops.metrics import read_records

EVAL_SIZE = 64  # the parity bound's set (docs/EVALUATION.md): at most 4 of its 64 answers may differ
MAX_ANSWER_CHARS = 40  # what metrics.jsonl keeps of an answer


def read_rounds(run_dir):
    return read_records(run_dir / "metrics.jsonl")


def export(*args: str):
    return run_python(["-m", "node.tools.export", *args], timeout=600)


def ask(*args: str):
    return run_python(["-m", "node.tools.ask", *args], timeout=600)


def greedy_answers(model, tokenizer, mix) -> list:
    tasks = eval_tasks(mix, EVAL_SIZE)
    result = evaluate(model, tokenizer, Prompter(tokenizer, mix), tasks, mix.max_new_tokens)
    return [None if a is None else a[:MAX_ANSWER_CHARS] for a in result.answers]


@pytest.fixture(scope="module")
def trained_default(tmp_path_factory):
    """3 rounds of the CPU recipe (cpu-learn, LoRA rank 8) on the default model, evaluated after the last by
    torch in fp32 (the node's evaluator the exports are compared with, exactly)."""
    run_dir = tmp_path_factory.mktemp("default") / "run"
    flags = ["--model", "default", "--recipe", "cpu", "--rounds", "3", "--generations", "4", "--seed", "5"]
    flags += ["--eval-every", "100", "--no-eval-round0", "--eval-size", str(EVAL_SIZE), "--eval-engine", "torch"]
    flags += ["--mixed-precision", "off", "--checkpoint-every", "1", "--run-dir", str(run_dir)]
    flags += ["--no-collapse-guard"]  # its restore would put other weights back after the evaluation
    done = run_node(*flags, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model_exports_answer_as_the_node_evaluated(trained_default, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    last = [r for r in read_rounds(trained_default) if "eval_answers" in r][-1]
    assert last["round"] == 2 and last["eval_engine"] == "torch" and last["eval_size"] == EVAL_SIZE
    mix = resolve_mix("cpu-learn")

    hf = tmp_path / "hf"
    done = export(str(trained_default), "--out", str(hf))
    assert done.returncode == 0, done.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(str(hf))  # offline: HF_HUB_OFFLINE=1 in the suite
    tokenizer = AutoTokenizer.from_pretrained(str(hf), padding_side="left")
    assert tokenizer.chat_template  # the node's prompt format travels with it
    base = AutoModelForCausalLM.from_pretrained(json.loads((hf / "sapo-export.json").read_text())["base"])
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), base.parameters()))
    assert moved > 0  # the adapter is merged in: these are not the base's weights
    del model, base

    facts = json.loads((hf / "sapo-export.json").read_text())
    assert facts["round"] == 2 and facts["lora"] == {"rank": 8, "alpha": 32.0} and facts["merged"] is True
    assert facts["eval_accuracy"] == last["eval_accuracy"] and facts["tasks"] == "cpu-learn"
    card = (hf / "README.md").read_text()
    assert f"{last['eval_accuracy']:.3f} on {EVAL_SIZE} tasks after round 2" in card and "cpu-learn" in card

    asked = ask(str(hf), "--eval", "--json")
    assert asked.returncode == 0, asked.stderr[-2000:]
    figures = json.loads(asked.stdout.strip().splitlines()[-1])
    assert figures["evaluator"] == "torch (fp32)" and figures["eval_answers"] == last["eval_answers"]
    assert figures["eval_accuracy"] == last["eval_accuracy"] and figures["eval_size"] == EVAL_SIZE
    assert figures["eval_baseline"] == last["eval_baseline"]

    peft_dir = tmp_path / "peft"
    assert export(str(trained_default), "--out", str(peft_dir), "--format", "peft").returncode == 0
    named = json.loads((peft_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(named)
    assert greedy_answers(PeftModel.from_pretrained(base, str(peft_dir)), tokenizer, mix) == last["eval_answers"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model_gguf_export_loads_in_llama_cpp_within_the_parity_bound(trained_default, tmp_path):
    need_llama("wheel")
    from node.learn.engines.llama import LlamaEngine
    from node.tools.ask import _tokenizer

    last = [r for r in read_rounds(trained_default) if "eval_answers" in r][-1]
    out = tmp_path / "gguf"
    done = export(str(trained_default), "--out", str(out), "--format", "gguf")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "Modelfile").read_text() == "FROM ./model-f16.gguf\n"
    tokenizer = _tokenizer(out)
    engine = LlamaEngine.from_file(out / "model-f16.gguf", tokenizer, binding="wheel")
    mix = resolve_mix("cpu-learn")
    tasks = eval_tasks(mix, EVAL_SIZE)
    result = evaluate(None, tokenizer, Prompter(tokenizer, mix), tasks, mix.max_new_tokens, engine=engine)
    engine.close()
    answers = [None if a is None else a[:MAX_ANSWER_CHARS] for a in result.answers]
    differ = sum(a != b for a, b in zip(answers, last["eval_answers"]))
    assert differ <= 4, f"{differ} of {EVAL_SIZE} answers differ from the node's"
    assert abs(result.accuracy - last["eval_accuracy"]) <= 4 / EVAL_SIZE

    asked = ask(str(out), "What is 4 + 5?", "--json")
    assert asked.returncode == 0, asked.stderr[-2000:]
    reply = json.loads(asked.stdout.strip().splitlines()[-1])
    assert reply["completion"].startswith("<answer>")


@pytest.mark.slow
def test_full_fine_tuning_exports_its_weights_and_has_no_adapter_to_export(tmp_path, tiny_args):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    done = run_node(
        *tiny_args, "--lora-rank", "0", "--rounds", "2", "--checkpoint-every", "1", "--run-dir", str(run_dir)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "hf"
    assert export(str(run_dir), "--out", str(out), "--round", "0").returncode == 0
    saved = CheckpointStore.load(run_dir / "checkpoints" / "round-000000").model
    exported = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in saved.items() if k in exported)
    assert json.loads((out / "sapo-export.json").read_text())["lora"] is None

    refused = export(str(run_dir), "--out", str(tmp_path / "adapter"), "--format", "peft")
    assert refused.returncode == 2 and "no adapter to export alone" in refused.stderr
    assert not (tmp_path / "adapter").exists()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    flags = ["--model", "tiny-random", "--tasks", "smoke", "--generations", "3", "--max-new-tokens", "6"]
    flags += ["--lora-rank", "4", "--rounds", "2", "--checkpoint-every", "1", "--eval-every", "0"]
    assert run_node(*flags, "--run-dir", str(run_dir)).returncode == 0
    return run_dir


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no checkpoint", "no checkpoint (checkpoints/round-*) in this run dir"),
        ("no such round", "no checkpoint of round 7 (it has rounds 0, 1)"),
        ("out not empty", "not empty (--force replaces what is there)"),
        ("corrupt", "corrupt checkpoint"),
        ("gguf of a model without a GGUF vocabulary", "--format gguf: the llama engine needs a GGUF source"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tiny_run, tmp_path, case, expected):
    run_dir, out, extra = tiny_run, tmp_path / "out", []
    if case == "no checkpoint":
        run_dir = tmp_path / "empty-run"
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("")
    elif case == "no such round":
        extra = ["--round", "7"]
    elif case == "out not empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "corrupt":
        run_dir = tmp_path / "copy"
        shutil.copytree(tiny_run, run_dir)
        weights = run_dir / "checkpoints" / "round-000001" / "model.pt"
        weights.write_bytes(weights.read_bytes()[:-10] + b"0123456789")
    else:
        extra = ["--format", "gguf"]
    done = export(str(run_dir), "--out", str(out), *extra)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("sapo-export: error: ") and expected in lines[-1], done.stderr[-2000:]
    if case == "out not empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not list(tmp_path.glob(".tmp-*"))
    if case == "corrupt":
        assert "--round 0 takes an older one" in lines[-1]


def test_force_replaces_an_export_and_ask_answers_from_a_run_dir(tiny_run, tmp_path):
    out = tmp_path / "out"
    assert export(str(tiny_run), "--out", str(out), "--round", "0").returncode == 0
    assert export(str(tiny_run), "--out", str(out), "--force").returncode == 0
    assert json.loads((out / "sapo-export.json").read_text())["round"] == 1
    from_run = ask(str(tiny_run), "What is 4 + 5?", "--json")
    from_export = ask(str(out), "What is 4 + 5?", "--json")
    assert from_run.returncode == from_export.returncode == 0, from_run.stderr[-1500:] + from_export.stderr[-1500:]
    assert json.loads(from_run.stdout.splitlines()[-1]) == json.loads(from_export.stdout.splitlines()[-1])
    wrong = ask(str(tiny_run), "--eval", "no-such-mix")
    assert wrong.returncode == 2 and "sapo-ask: error: task mix 'no-such-mix'" in wrong.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not is_installed("gemma3-270m"),
    reason="gemma3-270m packages not installed (scripts/test.sh installs them; or SAPO_MODELS=gemma3-270m "
    "bash scripts/setup.sh)",
)
def test_gemma_exports_for_transformers_and_peft_and_says_gguf_is_llama_only(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    flags = ["--model", "gemma3-270m", "--tasks", "cpu-learn", "--lora-rank", "4", "--rounds", "1"]
    flags += ["--generations", "2", "--num-local", "1", "--max-new-tokens", "8", "--rollout-engine", "torch"]
    flags += ["--eval-every", "100", "--eval-size", "8", "--mixed-precision", "off", "--no-collapse-guard"]
    done = run_node(*flags, "--run-dir", str(run_dir), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    last = [r for r in read_rounds(run_dir) if "eval_answers" in r][-1]
    mix = resolve_mix("cpu-learn")
    tasks = eval_tasks(mix, 8)

    def answers(model, tokenizer):
        result = evaluate(model, tokenizer, Prompter(tokenizer, mix), tasks, 8)  # the run's --max-new-tokens
        return [None if a is None else a[:MAX_ANSWER_CHARS] for a in result.answers]

    hf, peft_dir = tmp_path / "hf", tmp_path / "peft"
    assert export(str(run_dir), "--out", str(hf)).returncode == 0
    tokenizer = AutoTokenizer.from_pretrained(str(hf), padding_side="left")
    assert answers(AutoModelForCausalLM.from_pretrained(str(hf)), tokenizer) == last["eval_answers"]
    assert export(str(run_dir), "--out", str(peft_dir), "--format", "peft").returncode == 0
    assert json.loads((peft_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    refused = export(str(run_dir), "--out", str(tmp_path / "gguf"), "--format", "gguf")
    assert refused.returncode == 2 and "llama-architecture models" in refused.stderr


def test_the_figures_of_the_weights_follow_a_collapse_guard_restore(tmp_path):
    """A restore puts older weights back: the card's figure is their evaluation, not the one that failed."""
    from node.ops.checkpoint import Checkpoint
    from node.ops.config import NodeConfig
    from node.tools.trained import TrainedRun

    rows = [
        {"round": 0, "start_accuracy": 0.2, "start_size": 8, "eval_accuracy": 0.5, "eval_size": 8},
        {"round": 1},
        {"round": 2, "eval_accuracy": 0.1, "eval_size": 8, "guard_action": "restore", "guard_restored_to": 0},
        {"round": 3, "eval_accuracy": 0.1, "guard_action": "restore", "guard_restored_to": -1},
        {"round": 4, "eval_accuracy": 0.9},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut")

    def figures(round_: int) -> tuple:
        ckpt = Checkpoint(round=round_, path=tmp_path, model={}, optimizer=None, state={})
        last = TrainedRun(ckpt, NodeConfig(), tmp_path).last_eval()
        return last["round"], last["eval_accuracy"]

    assert figures(1) == (0, 0.5)
    assert figures(2) == (0, 0.5)  # restored to round 0's weights
    assert figures(3) == (-1, 0.2)  # the starting weights, as their start_ evaluation scored them
    assert figures(4) == (4, 0.9)
