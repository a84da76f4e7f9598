"""LoRA on the real tiny model: only the adapter trains, the KL reference is the base with the adapter off,
peers on one shared base keep their adapters apart, and the trainer's paths (prefix sharing, stop hooks)
work through PEFT's wrapper."""

import copy

import pytest
import torch

from conftest import tiny_signal_groups
from node.learn.groups import to_sequences
from node.learn.lora import LoraBase, LoraSettings, attach, base_fingerprint
from node.learn.sampling import SamplingConfig, sample_groups, token_logprobs
from node.learn.stop import RoundAbandoned, StopRequest
from node.learn.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def tiny():
    model, tok, prompter, _, groups = tiny_signal_groups(seed=7, max_new_tokens=8)
    return model, tok, prompter, groups


def base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}


def snapshot(adapter):
    return {k: v.clone() for k, v in adapter.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_lora_step_changes_the_adapter_and_nothing_else(tiny):
    model, tok, prompter, groups = tiny
    fingerprint = base_fingerprint(model)
    assert base_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == fingerprint  # GPU weights: same base
    adapter = attach(copy.deepcopy(model), rank=4, alpha=8, seed=1)
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    # B starts at zero: the wrapped model is exactly the base, so pi_old from sampling still holds
    logp, mask = token_logprobs(adapter.model, seqs, tok.pad_token_id, 1.0)
    n = int(mask[0].sum())
    assert torch.allclose(logp[0, :n], torch.tensor(seqs[0].old_logp), atol=1e-4)
    trainer = Trainer(adapter.model, tok.pad_token_id, TrainConfig(lr=1e-2), adapter=adapter)
    assert trainer.shared_prefix  # the probe passes through PEFT's wrapper
    assert {id(p) for p in trainer.params} == {id(p) for p in adapter.parameters()}
    assert all(".lora_A." in k or ".lora_B." in k for k in adapter.state_dict())
    # q, k, v, o, gate, up, down in each of the 2 layers, A and B each; never the LM head or embeddings
    assert len(adapter.state_dict()) == 2 * 7 * 2
    before, adapter_before = base_weights(adapter.model), snapshot(adapter)
    stats = trainer.step(seqs)
    assert stats.optimizer_steps == 1
    assert same(base_weights(adapter.model), before)
    assert not same(snapshot(adapter), adapter_before)
    assert adapter.base.fingerprint == fingerprint
    assert adapter.num_parameters() < 0.2 * sum(p.numel() for p in model.parameters())


def test_shared_prefix_and_plain_give_the_same_adapter_gradients(tiny):
    model, tok, prompter, groups = tiny
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    grads = []
    for mode in ("off", "on"):
        adapter = attach(copy.deepcopy(model).double(), rank=2, alpha=4, seed=3)
        with torch.no_grad():  # B away from zero, so A gets gradients too
            for p in adapter.parameters():
                p.add_(0.05)
        t = Trainer(
            adapter.model,
            tok.pad_token_id,
            TrainConfig(lr=0.0, prefix_sharing=mode, max_grad_norm=1e9),
            adapter=adapter,
        )
        t._optimizer_step(copy.deepcopy(seqs), None)
        grads.append(torch.cat([p.grad.flatten() for p in adapter.parameters()]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-9, rtol=1e-6)


def test_kl_reference_is_the_base_with_the_adapter_disabled(tiny):
    model, tok, prompter, groups = tiny
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    adapter = attach(copy.deepcopy(model), rank=4, alpha=8, seed=1)
    trainer = Trainer(adapter.model, tok.pad_token_id, TrainConfig(lr=1e-2, beta=0.1), adapter=adapter)
    assert trainer.ref_model is None  # no second copy of the model
    trainer.step(seqs)
    trainer.step(seqs)  # the adapter now moves the policy away from the base
    refs = trainer._ref_logprobs(seqs)
    base_logp, mask = token_logprobs(model, seqs, tok.pad_token_id, 1.0)
    now_logp, _ = token_logprobs(adapter.model, seqs, tok.pad_token_id, 1.0)
    for i, s in enumerate(seqs):
        n = int(mask[i].sum())
        assert torch.allclose(torch.tensor(refs[id(s)]), base_logp[i, :n], atol=1e-5)
    assert not torch.allclose(now_logp * mask, base_logp * mask, atol=1e-4)
    assert trainer.step(seqs).kl > 0


def test_peers_on_one_base_keep_their_adapters_apart(tiny):
    """Round-robin like memory mode: peer A's step changes neither peer B's adapter nor B's outputs."""
    model, tok, prompter, groups = tiny
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    shared = LoraBase(copy.deepcopy(model), LoraSettings(rank=2, alpha=4))
    peers = [shared.adapter(f"peer{p}", seed=p) for p in range(3)]
    assert len({id(a.model) for a in peers}) == 1  # one base in memory
    trainers = [Trainer(a.model, tok.pad_token_id, TrainConfig(lr=1e-2), adapter=a) for a in peers]
    ids = [{id(p) for p in t.params} for t in trainers]
    assert not (ids[0] & ids[1] or ids[1] & ids[2] or ids[0] & ids[2])  # an optimizer per adapter
    base = base_weights(shared.model)

    def outputs(adapter):
        adapter.activate()
        return token_logprobs(adapter.model, seqs, tok.pad_token_id, 1.0)[0]

    peers[1].activate()  # as a node's model thread does before each piece of its work
    trainers[1].step(copy.deepcopy(seqs))  # B away from zero: its outputs differ from the base
    b_state, b_out, c_state = snapshot(peers[1]), outputs(peers[1]), snapshot(peers[2])
    a_state = snapshot(peers[0])
    peers[0].activate()
    trainers[0].step(copy.deepcopy(seqs))  # peer A's round
    assert not same(snapshot(peers[0]), a_state)
    assert same(snapshot(peers[1]), b_state) and same(snapshot(peers[2]), c_state)
    assert torch.equal(outputs(peers[1]), b_out)
    assert same(base_weights(shared.model), base)
    # A's sampler runs through A once A is active again, and B's through B
    peers[0].activate()
    torch.manual_seed(0)
    a_groups = sample_groups(shared.model, tok, [prompter(groups[0].task)], 2, SamplingConfig(max_new_tokens=4))
    assert a_groups[0].completion_ids
    assert not torch.equal(outputs(peers[0]), outputs(peers[1]))


def test_stop_hooks_fire_inside_the_peft_wrapped_model(tiny):
    model, tok, prompter, groups = tiny
    adapter = attach(copy.deepcopy(model), rank=2, alpha=4)
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    stop = StopRequest()
    calls = []
    with stop.watch(adapter.model, lambda: calls.append(1) or True):
        token_logprobs(adapter.model, seqs[:1], tok.pad_token_id, 1.0)
        stop.set("test")
        with pytest.raises(RoundAbandoned):
            token_logprobs(adapter.model, seqs[:1], tok.pad_token_id, 1.0)
    assert calls  # a layer's hook, not a safe point outside the model, raised


def test_adapter_weights_load_strictly(tiny):
    model, _, _, _ = tiny
    a = attach(copy.deepcopy(model), rank=2, alpha=4, seed=1)
    b = attach(copy.deepcopy(model), rank=2, alpha=4, seed=2)
    c = attach(copy.deepcopy(model), rank=4, alpha=4, seed=2)
    b.load_state_dict(a.state_dict())  # names carry no adapter name: any peer's adapter loads
    assert same(snapshot(a), snapshot(b))
    with pytest.raises(ValueError, match="rank-4"):
        c.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({})


def test_a_peer_on_a_shared_base_answers_as_its_weights_alone_do(tiny):
    """Evaluation is a function of a peer's weights: the same adapter, on a base shared with other peers (memory
    mode) or alone on its own, in bf16 as a node on a bf16 CPU runs it, gives the same log-probs bit for bit
    and the same greedy answers. (A veteran's first evaluation in a swarm differs from its last one alone only
    because a round's evaluation follows that round's update.)"""
    from node.learn import precision
    from node.learn.evaluate import greedy_texts

    model, tok, prompter, groups = tiny
    seqs = to_sequences(groups, tok, prompter, scale_std=True)
    prompts = [prompter(g.task) for g in groups]
    shared = LoraBase(copy.deepcopy(model), LoraSettings(rank=2, alpha=4))
    peers = [shared.adapter(f"peer{p}", seed=p) for p in range(3)]
    shared.store_frozen_weights_as(torch.bfloat16)
    cpu = torch.device("cpu")
    for peer in peers[1:]:  # two trained peers, different from the base and from each other
        peer.activate()
        with precision.autocast("bf16", cpu):
            Trainer(peer.model, tok.pad_token_id, TrainConfig(lr=5e-2), adapter=peer).step(copy.deepcopy(seqs))

    def answers(adapter):
        adapter.activate()
        with precision.autocast("bf16", cpu), torch.no_grad():
            logp = token_logprobs(adapter.model, seqs, tok.pad_token_id, 1.0)[0]
            return logp, greedy_texts(adapter.model, tok, prompts, max_new_tokens=6, batch_size=2)

    alone = LoraBase(copy.deepcopy(model), LoraSettings(rank=2, alpha=4)).adapter("peer0", seed=9)
    alone.base.store_frozen_weights_as(torch.bfloat16)
    alone.load_state_dict(peers[1].state_dict())
    in_swarm, by_itself = answers(peers[1]), answers(alone)
    assert torch.equal(in_swarm[0], by_itself[0]) and in_swarm[1] == by_itself[1]
    assert not torch.equal(answers(peers[2])[0], in_swarm[0])  # the other trained peer does answer differently
    assert torch.equal(answers(peers[1])[0], in_swarm[0])  # and evaluating it changed nothing for peer 1
