"""Mixed precision (node/learn/precision.py), the bf16 pieces it brings along (a LoRA base stored in bf16,
stochastically rounded merged exports) and the llama engine's token draw."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import node.learn.precision as precision
from node.learn.engines.gguf_export import base_model, lora_deltas, stochastic_bf16, write_model
from node.learn.engines.llama import _draw
from node.learn.groups import Prompter, local_group, to_sequences
from node.learn.model_io import load_model
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import PRESETS, TaskSampler
from node.learn.trainer import TrainConfig, Trainer

CPU = torch.device("cpu")


def test_auto_is_bf16_only_where_the_device_computes_in_bf16(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: True)
    monkeypatch.setattr(precision, "cuda_bf16", lambda: False)
    assert precision.resolve("auto", CPU) == "bf16"
    assert precision.resolve("auto", torch.device("cuda")) == "off"  # a GPU before Ampere
    monkeypatch.setattr(precision, "cuda_bf16", lambda: True)
    assert precision.resolve("auto", torch.device("cuda:0")) == "bf16"
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: False)
    assert precision.resolve("auto", CPU) == "off"
    assert precision.resolve("bf16", CPU) == "bf16" and precision.resolve("off", CPU) == "off"
    with pytest.raises(ValueError, match="mixed precision"):
        precision.resolve("fp8", CPU)


def _groups(model, tok, n_tasks=2, G=4):
    mix = PRESETS["smoke"]
    prompter = Prompter(tok, mix)
    tasks = TaskSampler(mix, seed=3).sample(n_tasks)
    torch.manual_seed(0)
    sampled = sample_groups(model, tok, [prompter(t) for t in tasks], G, SamplingConfig(max_new_tokens=6))
    groups = [local_group(t, s, mix.answer_prefix) for t, s in zip(tasks, sampled)]
    for g in groups:
        g.rewards = [float(j % 2) for j in range(len(g.rewards))]
    return groups, prompter


def test_a_small_update_survives_only_in_fp32_master_weights():
    """Why the model is loaded in fp32 on a GPU too: one Adam step at the paper's lr 1e-6 moves fp32 weights,
    while the same step on bf16-stored weights rounds away in nearly every weight."""
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        weight = torch.nn.Parameter((torch.randn(256, 256) * 0.03).to(dtype))
        before = weight.detach().clone()
        optimizer = torch.optim.Adam([weight], lr=1e-6)
        (weight.float() ** 2).sum().backward()
        optimizer.step()
        moved[dtype] = (weight.detach() != before).float().mean().item()
    assert moved[torch.float32] > 0.99
    assert moved[torch.bfloat16] < 0.05


def test_an_update_under_bf16_autocast_keeps_fp32_weights_and_a_ratio_of_one():
    """Matmuls in bf16, the weights (masters) and their update in fp32; the samples' recorded log-probs are
    not the update's numerics, so pi_old is the step's own forward: the first step's ratio is exactly 1."""
    model, tok = load_model("tiny-random", CPU)
    groups, prompter = _groups(model, tok)
    before = copy.deepcopy(model.state_dict())
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    for s in seqs:
        s.old_logp = None  # what TorchEngine(logp_exact=False) hands the trainer
    trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-3))
    with precision.autocast("bf16", CPU):
        stats = trainer.step(seqs)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-6) and stats.clip_frac == 0.0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved, "the update changed no weight"


def test_the_update_runs_eager_attention_on_a_cpu_under_bf16_and_scores_what_sdpa_scores():
    """On a CPU under bf16 autocast the update's passes use eager attention (faster backward there), only for
    the update: the same log-probs as SDPA's within bf16 rounding, on the shared-prefix layout (prompt cache +
    completions, where a wrong mask would show), and SDPA again afterwards, also after an error; fp32 keeps
    SDPA."""
    from node.learn.prefix import micro_batches

    model, tok = load_model("tiny-random", CPU)
    groups, prompter = _groups(model, tok)
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    assert model.config._attn_implementation == "sdpa"

    def scored() -> torch.Tensor:
        return torch.cat(
            [logp[mask > 0] for _, logp, mask in micro_batches(model, seqs, tok.pad_token_id, 1.0, 4, True)]
        )

    with precision.update_attention(model):
        assert model.config._attn_implementation == "sdpa"  # not under bf16 autocast
    with torch.no_grad(), precision.autocast("bf16", CPU):
        fused = scored()
        with precision.update_attention(model):
            assert model.config._attn_implementation == "eager"
            eager = scored()
        assert model.config._attn_implementation == "sdpa"
        with pytest.raises(RuntimeError), precision.update_attention(model):
            raise RuntimeError("an update that fails")
        assert model.config._attn_implementation == "sdpa"
    assert (eager - fused).abs().max() < 0.01  # bf16 rounding (~0.002); 3 prompt tokens fewer move it by >1


def test_a_lora_base_stored_in_bf16_trains_its_fp32_adapter_and_keeps_other_adapters():
    pytest.importorskip("peft")
    from node.learn.lora import LoraBase, LoraSettings

    model, tok = load_model("tiny-random", CPU)
    base = LoraBase(model, LoraSettings(4, 8.0))
    a, b = base.adapter("peer_a", seed=0), base.adapter("peer_b", seed=1)
    a.activate()
    assert base.store_frozen_weights_as(torch.bfloat16) > 0
    dtypes = {n: p.dtype for n, p in base.model.named_parameters()}
    assert all(dt == torch.float32 for n, dt in dtypes.items() if ".lora_" in n)  # both peers' adapters
    assert any(dt == torch.bfloat16 for n, dt in dtypes.items() if ".lora_" not in n)
    with precision.autocast("bf16", CPU):
        groups, prompter = _groups(base.model, tok)
        b_before = {k: v.clone() for k, v in b.state_dict().items()}
        a_before = {k: v.clone() for k, v in a.state_dict().items()}
        seqs = to_sequences(groups, tok, prompter, scale_std=True)
        Trainer(a.model, tok.pad_token_id, TrainConfig(lr=1e-2), adapter=a).step(seqs)
    assert any(not torch.equal(v, a_before[k]) for k, v in a.state_dict().items())
    assert all(torch.equal(v, b_before[k]) for k, v in b.state_dict().items())


def test_a_base_stored_in_bf16_runs_under_autocast_wherever_it_is_called():
    """A model a node was built on (its frozen weights cast to bf16) can be sampled from, generated with and
    trained outside the node's precision context: its forwards enter autocast themselves, through the
    adapter's wrapper and through the base model alike, and leave it when they return (or raise)."""
    pytest.importorskip("peft")
    from node.learn.lora import LoraBase, LoraSettings

    model, tok = load_model("tiny-random", CPU)
    base = LoraBase(model, LoraSettings(4, 8.0))
    adapter = base.adapter("peer", seed=0)
    base.store_frozen_weights_as(torch.bfloat16)
    groups = sample_groups(base.model, tok, ["Q: 1+1?\nA:"] * 2, 2, SamplingConfig(max_new_tokens=4))
    assert len(groups) == 2 and all(len(g.completion_ids) == 2 for g in groups)
    ids = tok(["Q: 2+2?"], return_tensors="pt")["input_ids"]
    assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    assert not torch.is_autocast_enabled("cpu")  # every context it opened is closed again
    with pytest.raises(IndexError):
        model(input_ids=torch.tensor([[10**6]]))  # a token id past the vocabulary: the forward raises
    assert not torch.is_autocast_enabled("cpu")
    seqs = to_sequences(
        [local_group(t, g, "") for t, g in zip(TaskSampler(PRESETS["smoke"], 0).sample(2), groups)],
        tok,
        Prompter(tok, PRESETS["smoke"]),
        scale_std=True,
    )
    for s in seqs:
        s.advantage = 1.0
    Trainer(adapter.model, tok.pad_token_id, TrainConfig(lr=1e-2), adapter=adapter).step(seqs)


def test_stochastic_bf16_rounding_is_unbiased_where_round_to_nearest_drops_small_updates():
    """A weight on the bf16 grid plus an update of a tenth of a grid step: round-to-nearest gives the
    weight back (the update is lost), stochastic rounding keeps it on average."""
    torch.manual_seed(0)
    w = torch.full((200_000,), 1.0)  # on the bf16 grid; one grid step above 1.0 is 2**-7
    delta = 0.1 * 2**-7
    x = w + delta
    assert torch.equal(x.to(torch.bfloat16).float(), w)
    rounded = stochastic_bf16(x).float()
    assert set(rounded.unique().tolist()) <= {1.0, 1.0 + 2**-7}
    assert (rounded - w).mean().item() == pytest.approx(delta, rel=0.05)
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -2.5])
    assert torch.equal(stochastic_bf16(special).float(), special)
    assert torch.isnan(stochastic_bf16(torch.tensor([float("nan")]))).all()
    consumed = x.clone()
    assert torch.equal(stochastic_bf16(consumed, consume=True).float(), consumed)  # rounded in place
    torch.manual_seed(1)
    again = stochastic_bf16(x)
    torch.manual_seed(1)
    assert torch.equal(stochastic_bf16(x), again)  # torch's RNG decides: a resumed node rounds alike


def test_a_lora_base_is_encoded_once_per_engine_and_an_in_place_change_is_seen(tmp_path, monkeypatch):
    """Each sync writes the whole model; the tensors no adapter touches (embedding, norms) are encoded once.
    A change in place (full fine-tuning's optimizer) bumps the tensor's version, so it is encoded again."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("peft")
    from node.learn.lora import attach

    model, _ = load_model("tiny-random-smol", CPU)
    adapter = attach(model, rank=4, alpha=8.0)
    frozen: dict = {}

    def embedding(i: int) -> np.ndarray:
        path = write_model(tmp_path / f"m{i}.gguf", adapter.model, [], "bf16", merge_lora=True, frozen=frozen)
        return np.array(next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight").data)

    import node.learn.engines.gguf_export as export

    encoded = []
    real_encode = export._encode
    monkeypatch.setattr(export, "_encode", lambda array, wt: encoded.append(array.shape) or real_encode(array, wt))
    first = embedding(0)
    cached, n_first = set(frozen), len(encoded)
    assert cached and n_first >= len(cached)
    assert embedding(1).tobytes() == first.tobytes() and set(frozen) == cached
    assert len(encoded) == n_first  # the second write encoded nothing: every untouched tensor came from the cache
    with torch.no_grad():
        base_model(adapter.model).get_input_embeddings().weight.add_(1.0)
    assert embedding(2).tobytes() != first.tobytes() and len(frozen) == len(cached)  # stale entry replaced


def test_lora_deltas_are_what_peft_adds_to_each_layer():
    pytest.importorskip("peft")
    from node.learn.lora import attach

    model, tok = load_model("tiny-random-smol", CPU)
    adapter = attach(model, rank=4, alpha=8.0)
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    deltas = lora_deltas(adapter.model)
    assert len(deltas) == 7 * model.config.num_hidden_layers
    layer = adapter.model.base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        expected = layer(x) - layer.base_layer(x)
    assert torch.allclose(x @ deltas["blk.0.ffn_down"].T, expected, atol=1e-5)


def _reference_draw(logits: np.ndarray, top_p: float, u: np.ndarray):
    """The plain float64 definition: softmax, nucleus, inverse CDF at the given uniforms."""
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    p = np.exp(x - lse[:, None])
    entropy = -(p * (x - lse[:, None])).sum(1)
    pick = p.copy()
    if top_p < 1.0:
        order = np.argsort(-p, axis=1)
        sp = np.take_along_axis(p, order, 1)
        keep = np.cumsum(sp, 1) - sp < top_p
        pick = np.zeros_like(p)
        np.put_along_axis(pick, order, sp * keep, 1)
    cdf = np.cumsum(pick, 1)
    tokens = np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(1), x.shape[1] - 1)
    return tokens, x[np.arange(len(x)), tokens] - lse, entropy


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_llama_engine_token_draw_is_the_plain_inverse_cdf(top_p):
    """The blocked two-level draw picks the same tokens as one cumulative sum over the vocabulary, with the
    same log-probs and entropies, on a vocabulary that is not a multiple of the block."""
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((64, 5000)) * 4).astype(np.float32)
    tokens, logp, entropy = _draw(logits, SamplingConfig(temperature=1.0, top_p=top_p), np.random.default_rng(9))
    ref_tokens, ref_logp, ref_entropy = _reference_draw(logits, top_p, np.random.default_rng(9).random(64))
    assert (tokens == ref_tokens).mean() >= 0.98  # float32 vs float64 sums may split a boundary
    same = tokens == ref_tokens
    assert np.allclose(logp[same], ref_logp[same], atol=1e-4)
    assert np.allclose(entropy, ref_entropy, atol=1e-4)


def test_llama_engine_token_draw_follows_the_distribution():
    logits = np.log(np.array([[0.5, 0.25, 0.125, 0.0625, 0.0625]], dtype=np.float32)).repeat(40_000, 0)
    tokens, _, _ = _draw(logits, SamplingConfig(temperature=1.0, top_p=1.0), np.random.default_rng(2))
    freq = np.bincount(tokens, minlength=5) / len(tokens)
    assert np.allclose(freq, [0.5, 0.25, 0.125, 0.0625, 0.0625], atol=0.01)
    tokens, _, _ = _draw(logits, SamplingConfig(temperature=1.0, top_p=0.7), np.random.default_rng(2))
    assert set(np.unique(tokens)) == {0, 1}  # the nucleus reaching 0.7: 0.5 + 0.25


@pytest.mark.parametrize("rows", [1, 3])
def test_the_lm_head_gets_its_last_position_in_row_major_strides(rows):
    """A bf16 CPU matmul on a strided input copies the whole transposed head first (145 ms against 8 ms for
    the default model's); a one-prompt slice counts as contiguous yet keeps the slice's batch stride."""
    model, _ = load_model("tiny-random", CPU)
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0].stride()))
    ids = torch.randint(3, 200, (rows, 7))
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)
        model(input_ids=ids, logits_to_keep=4)
    d = model.config.hidden_size
    assert seen == [(d, d, 1), (4 * d, d, 1)]
