"""Rollout engines on real tiny models: the torch engine is today's sampler, an unavailable engine falls
back to torch, llama.cpp's samples are valid and stop between tokens, and pi_old is exact (ratio 1 before
the first optimizer step) when the samples' log-probs are not the trained model's.

The llama.cpp tests run on each binding (node/learn/engines/llama_api.py): the wheel, which setup installs
by default (its tests fail, not skip, where it is missing, unless setup was told SAPO_ENGINE=torch), and
the source build where it is installed."""

import copy
import logging
import os
import sys

import pytest
import torch

import node.learn.trainer as trainer_mod
from conftest import BINDINGS, small_silo_node
from conftest import need_llama as need
from node.learn.engines import engine_label, make_engine
from node.learn.engines.torch import TorchEngine
from node.learn.groups import Prompter, local_group, to_sequences
from node.learn.model_io import load_model
from node.learn.sampling import SamplingConfig, Sequence, sample_groups, token_logprobs
from node.learn.stop import RoundAbandoned, StopRequest
from node.learn.tasks import PRESETS, TaskSampler
from node.learn.trainer import TrainConfig, Trainer

MIX = PRESETS["cpu-easy"]


@pytest.fixture(scope="module")
def smol():
    """The tiny random Llama with SmolLM2's tokenizer (the one llama.cpp can be given) and three prompts."""
    model, tok = load_model("tiny-random-smol", torch.device("cpu"))
    prompter = Prompter(tok, MIX)
    tasks = TaskSampler(MIX, seed=7).sample(3)
    return model, tok, prompter, tasks, [prompter(t) for t in tasks]


def test_torch_engine_is_todays_sampler(smol):
    model, tok, _, _, prompts = smol
    cfg = SamplingConfig(max_new_tokens=6)
    torch.manual_seed(11)
    expected = sample_groups(model, tok, prompts, 4, cfg)
    torch.manual_seed(11)
    engine = make_engine("torch", model, tok)
    assert engine_label(engine) == "torch"
    got = engine.sample(prompts, 4, cfg)
    assert [g.completion_ids for g in got] == [g.completion_ids for g in expected]
    assert [g.behaviour_logp for g in got] == [g.behaviour_logp for g in expected]
    assert all(g.logp_exact for g in got)


def _uninstalled(monkeypatch) -> None:
    """As if neither llama.cpp binding were installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setitem(sys.modules, "ik_llama_cpp", None)


def _engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "node.learn.engines"]


def test_unavailable_engine_falls_back_to_torch_in_one_line(smol, monkeypatch, caplog):
    model, tok, _, _, _ = smol
    _uninstalled(monkeypatch)
    with caplog.at_level(logging.INFO, logger="node.learn.engines"):
        engine = make_engine("llama", model, tok, "tiny-random-smol")
    assert isinstance(engine, TorchEngine)
    lines = _engine_lines(caplog)
    assert len(lines) == 1 and "sampling with torch" in lines[0]
    assert caplog.records[-1].levelno == logging.WARNING  # asked for by name: a warning


def test_auto_is_llama_where_it_imports_and_torch_otherwise_in_one_line(smol, monkeypatch, caplog):
    model, tok, _, _, _ = smol
    need("any")
    with caplog.at_level(logging.INFO, logger="node.learn.engines"):
        engine = make_engine("auto", model, tok, "tiny-random-smol")
    try:
        assert engine.name == "llama"
        assert _engine_lines(caplog) == [f"rollout engine auto: llama.cpp through {engine.api.label}"]
    finally:
        engine.close()
    caplog.clear()
    _uninstalled(monkeypatch)
    with caplog.at_level(logging.INFO, logger="node.learn.engines"):
        assert isinstance(make_engine("auto", model, tok, "tiny-random-smol"), TorchEngine)
    lines = _engine_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("rollout engine auto: torch (llama.cpp unavailable: ")
    assert all(r.levelno == logging.INFO for r in caplog.records)  # the default finding no engine: no warning


def test_auto_keeps_torch_for_a_model_on_a_gpu(smol, caplog):
    """On a GPU `auto` stays today's default (torch) without trying llama.cpp: a meta-device model stands in
    for one on a GPU (make_engine looks only at where the parameters live)."""
    _, tok, _, _, _ = smol
    model = torch.nn.Linear(2, 2, device="meta")
    with caplog.at_level(logging.INFO, logger="node.learn.engines"):
        assert isinstance(make_engine("auto", model, tok, "tiny-random-smol"), TorchEngine)
    assert _engine_lines(caplog) == ["rollout engine auto: torch (the model is on meta)"]


@pytest.mark.parametrize("binding", BINDINGS)
def test_engine_that_cannot_serve_the_model_falls_back(caplog, binding):
    need(binding)
    model, tok = load_model("tiny-random", torch.device("cpu"))  # byte tokenizer: no GGUF vocabulary for it
    with caplog.at_level(logging.WARNING, logger="node.learn.engines"):
        assert isinstance(make_engine("llama", model, tok, "tiny-random", llama_binding=binding), TorchEngine)
    assert "unavailable" in caplog.text


def _first_ratio(monkeypatch) -> list[torch.Tensor]:
    """Records the probability ratio of every grpo_loss call (per token, masked)."""
    seen = []
    real = trainer_mod.grpo_loss

    def spy(logp, old, adv, mask, *args, **kwargs):
        seen.append((torch.exp(logp - old) * mask + (1 - mask)).detach())
        return real(logp, old, adv, mask, *args, **kwargs)

    monkeypatch.setattr(trainer_mod, "grpo_loss", spy)
    return seen


@pytest.mark.parametrize("epochs", [1, 2])
def test_pi_old_ratio_is_one_before_the_first_step_with_inexact_samples(smol, monkeypatch, epochs):
    """Samples whose log-probs are another engine's (here: deliberately wrong ones) train with pi_old
    formed by the training model: the first step's ratio is exactly 1 (one step: the step's own forward;
    several: one no-grad pass before them), and the wrong log-probs never reach the loss."""
    model, tok, prompter, tasks, prompts = smol
    torch.manual_seed(3)
    sampled = sample_groups(model, tok, prompts, 4, SamplingConfig(max_new_tokens=6))
    groups = [local_group(t, s, MIX.answer_prefix) for t, s in zip(tasks, sampled)]
    for g in groups:
        g.rewards = [1.0, 0.0, 0.5, 0.0]
        g.sampled.logp_exact = False
        g.sampled.behaviour_logp = [[-50.0] * len(c) for c in g.sampled.completion_ids]
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    assert all(s.old_logp is None for s in seqs)
    ratios = _first_ratio(monkeypatch)
    trainer = Trainer(copy.deepcopy(model), tok.pad_token_id, TrainConfig(lr=1e-2, epochs=epochs, micro_batch_size=4))
    real_step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: (ratios.append(None), real_step(*a, **k))[1]  # marks step ends
    stats = trainer.step(seqs)
    first_step = ratios[: ratios.index(None)]  # the micro-batches of the first optimizer step
    later = [r for r in ratios[len(first_step) :] if r is not None]
    if epochs == 1:  # the very forward pass that pi_old is taken from: exactly 1
        assert all(torch.equal(r, torch.ones_like(r)) for r in first_step)
    else:  # a separate no-grad pass over the same weights: 1 up to float rounding
        assert all(torch.allclose(r, torch.ones_like(r), rtol=0, atol=1e-5) for r in first_step)
    assert stats.optimizer_steps == epochs
    if epochs == 2:  # the second step sees moved weights against the same pi_old
        assert any(not torch.allclose(r, torch.ones_like(r), rtol=0, atol=1e-3) for r in later)


# --- llama.cpp -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=BINDINGS)
def llama(smol, request):
    need(request.param)
    model, tok, *_ = smol
    engine = make_engine("llama", model, tok, "tiny-random-smol", llama_binding=request.param)
    assert engine.name == "llama" and engine.api.name == request.param
    # the records name the binding: the wheel and a source build differ in kernels and speed
    label = engine_label(engine)
    assert label == f"llama: {engine.api.label}" and label.endswith(("(wheel)", "(built from source)"))
    yield engine
    engine.close()


def test_llama_engine_samples_valid_groups(smol, llama):
    model, tok, _, _, prompts = smol
    cfg = SamplingConfig(max_new_tokens=8)
    torch.manual_seed(5)
    groups = llama.sample(prompts, 4, cfg)
    torch.manual_seed(5)
    again = llama.sample(prompts, 4, cfg)
    assert [g.completion_ids for g in groups] == [g.completion_ids for g in again]  # seeded by torch's RNG
    for g, prompt in zip(groups, prompts):
        assert g.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
        assert len(g.completion_ids) == 4 and not g.logp_exact
        for ids, lps, text in zip(g.completion_ids, g.behaviour_logp, g.texts):
            assert 1 <= len(ids) <= 8 and len(lps) == len(ids)
            assert tok.eos_token_id not in ids[:-1]  # a completion ends at its first EOS
            assert all(0 <= t < len(tok) for t in ids) and all(lp <= 0 for lp in lps)
            assert text == tok.decode(ids, skip_special_tokens=True)


def _max_logp_gap(model, tok, groups) -> float:
    seqs = [Sequence(g.prompt_ids, c, 0.0) for g in groups for c in g.completion_ids]
    with torch.no_grad():
        logp, mask = token_logprobs(model, seqs, tok.pad_token_id, 1.0)
    engine = torch.zeros_like(logp)
    for i, lp in enumerate(lp for g in groups for lp in g.behaviour_logp):
        engine[i, : len(lp)] = torch.tensor(lp)
    return float(((logp - engine).abs() * mask).max())


def test_llama_engine_samples_the_weights_it_was_synced_to(smol, llama):
    """Its behaviour log-probs are the synced model's (up to f16 weights and llama.cpp's kernels), not the
    previous model's: the export (tensor names, query/key row order) and the sync are right."""
    model, tok, _, _, prompts = smol
    moved = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    cfg = SamplingConfig(max_new_tokens=6)
    torch.manual_seed(2)
    before = llama.sample(prompts, 2, cfg)
    assert _max_logp_gap(model, tok, before) < 0.05
    llama.sync(moved)
    try:
        torch.manual_seed(2)
        after = llama.sample(prompts, 2, cfg)
        assert _max_logp_gap(moved, tok, after) < 0.05
        assert _max_logp_gap(model, tok, after) > 0.2
    finally:
        llama.sync(model)


def test_llama_engine_stops_between_decode_steps(smol, llama):
    model, tok, _, _, prompts = smol
    stop = StopRequest()
    calls = {"n": 0}
    real = llama._decode

    def decode_then_stop(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            stop.set("test")
        return real(*args)

    llama._decode = decode_then_stop
    try:
        with pytest.raises(RoundAbandoned):
            llama.sample(prompts, 4, SamplingConfig(max_new_tokens=200), stop)
    finally:
        del llama._decode
    assert calls["n"] == 2  # the prefill and one step, not 200


@pytest.mark.parametrize("binding", BINDINGS)
@pytest.mark.parametrize("weights", ["bf16", "f16"])
def test_llama_engine_samples_a_synced_lora_adapter(smol, weights, binding):
    """With LoRA the adapter moves into llama.cpp, merged into bf16 weights (stochastic rounding) or as an
    adapter on f16 weights; either way its samples' log-probs are the adapted model's."""
    need(binding)
    pytest.importorskip("peft")
    from node.learn.lora import attach

    model, tok, _, _, prompts = smol
    adapter = attach(copy.deepcopy(model), rank=4, alpha=8.0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)  # B = 0 at start: move it so the adapter matters
    engine = make_engine("llama", adapter.model, tok, "tiny-random-smol", weight_type=weights, llama_binding=binding)
    if binding == "wheel" and weights == "f16":  # the wheel merges LoRA only (an adapter on top gave NaN)
        assert isinstance(engine, TorchEngine)
        return
    try:
        assert engine.name == "llama" and engine.api.name == binding
        assert (engine._adapter is None) == (weights == "bf16")  # merged, or an adapter on top
        torch.manual_seed(4)
        groups = engine.sample(prompts, 2, SamplingConfig(max_new_tokens=6))
        assert _max_logp_gap(adapter.model, tok, groups) < 0.05
        with adapter.disabled():
            assert _max_logp_gap(adapter.model, tok, groups) > 0.2
    finally:
        engine.close()


async def test_a_node_with_the_llama_engine_syncs_after_each_update(tmp_path, smol):
    """The round loop: the engine samples round 0 from the initial weights, and every later round starts
    with a `sync` phase (the update moved the weights); the records are an ordinary node's."""
    need("any")

    model, tok, *_ = smol
    node = small_silo_node(
        model, tok, "tiny-random-smol", 2, tmp_path, "--eval-every", "0", "--rollout-engine", "llama"
    )
    try:
        assert node.engine.name == "llama"
        records = [(await node.run_round(r)).record for r in range(2)]
    finally:
        node.worker.shutdown()
        node.engine.close()
    assert "sync" not in records[0]["phase_s"]
    assert ("sync" in records[1]["phase_s"]) == (records[0]["optimizer_steps"] > 0)
    assert all(r["tokens_generated"] > 0 for r in records)


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm here")
def test_a_full_dev_shm_moves_the_engine_scratch_dir_instead_of_failing_the_round(caplog):
    """Shared memory checked at start can fill up later (other processes use it): the write that hits ENOSPC
    is repeated in the default temporary directory, and later writes go there."""
    import errno
    import tempfile
    from pathlib import Path

    from node.learn.engines.llama import LlamaEngine

    engine = LlamaEngine.__new__(LlamaEngine)  # only the scratch directory matters here: no llama.cpp needed
    engine.dir = tempfile.TemporaryDirectory(prefix="sapo-test-", dir="/dev/shm")
    shm_dir = engine.dir.name
    tries = []

    def write(d: Path) -> Path:
        tries.append(d)
        if str(d).startswith("/dev/shm/"):
            raise OSError(errno.ENOSPC, "No space left on device")
        (d / "model.gguf").write_bytes(b"x")
        return d / "model.gguf"

    with caplog.at_level(logging.WARNING):
        path = engine._write(write)
    assert path.read_bytes() == b"x" and not str(path).startswith("/dev/shm/")
    assert [str(t) for t in tries] == [shm_dir, engine.dir.name] and not os.path.exists(shm_dir)
    assert "/dev/shm is full" in caplog.text
    with pytest.raises(OSError):  # any other error is the caller's
        engine._write(lambda d: (_ for _ in ()).throw(OSError(errno.EACCES, "denied")))
    engine.dir.cleanup()
