"""Safe points on a real tiny model: generation stops within a token, training never after a step began."""

import copy
import threading

import pytest
import torch

from conftest import tiny_signal_groups
from node.learn.groups import to_sequences
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.stop import RoundAbandoned, StopRequest
from node.learn.trainer import TrainConfig, Trainer


class StopAfter(StopRequest):
    """A stop request that sets itself at its n-th poll: where exactly the code polls becomes visible."""

    def __init__(self, polls: int):
        super().__init__()
        self.polls, self.left = 0, polls

    def is_set(self) -> bool:
        self.polls += 1
        self.left -= 1
        if self.left == 0:
            self.set("test")
        return super().is_set()

    def check(self) -> None:
        self.is_set()
        super().check()


@pytest.fixture(scope="module")
def tiny():
    return tiny_signal_groups(seed=5, max_new_tokens=8)


def test_generation_is_abandoned_between_two_tokens(tiny):
    model, tok, prompter, tasks, _ = tiny
    stop = StopAfter(polls=4)  # one poll before generating, then one per token
    with pytest.raises(RoundAbandoned):
        sample_groups(model, tok, [prompter(t) for t in tasks], 4, SamplingConfig(max_new_tokens=200), stop)
    assert stop.polls == 4  # it stopped at the poll that saw the request, not 200 tokens later
    assert model.training  # train mode restored on the way out


def test_training_is_abandoned_before_its_first_optimizer_step_only(tiny):
    model, tok, prompter, _, groups = tiny
    cfg = TrainConfig(lr=1e-2, minibatches=2, micro_batch_size=2)
    seqs = to_sequences(groups, tok, prompter, scale_std=True)

    model_a = copy.deepcopy(model)
    before = copy.deepcopy(model_a.state_dict())
    trainer = Trainer(model_a, tok.pad_token_id, cfg, stop=StopAfter(polls=2))  # 2nd micro-batch of the 1st
    with pytest.raises(RoundAbandoned):
        trainer.step(copy.deepcopy(seqs))
    assert all(torch.equal(before[k], v) for k, v in model_a.state_dict().items())
    assert not trainer.optimizer.state  # Adam never stepped
    assert all(p.grad is None for p in model_a.parameters())  # half-accumulated gradients dropped

    # once the first optimizer step is taken, a stop no longer interrupts the update: it runs to its end
    late = StopRequest()
    trainer = Trainer(copy.deepcopy(model), tok.pad_token_id, cfg, stop=late)
    first_step = trainer.optimizer.step

    def step_then_stop(*args, **kwargs):
        result = first_step(*args, **kwargs)
        late.set("test")
        return result

    trainer.optimizer.step = step_then_stop
    stats = trainer.step(copy.deepcopy(seqs))
    assert late.is_set() and stats.optimizer_steps == 2


def test_stop_request_is_set_once_and_calls_back_from_the_setting_thread():
    stop, calls = StopRequest(), []
    stop.on_set(lambda: calls.append(threading.current_thread().name))
    worker = threading.Thread(target=stop.set, args=("SIGINT",), name="setter")
    worker.start()
    worker.join()
    stop.set("SIGTERM")
    stop.on_set(lambda: calls.append("late"))  # registered after the fact: called at once
    assert calls == ["setter", "late"] and stop.reason == "SIGINT"
    with pytest.raises(RoundAbandoned, match="SIGINT"):
        stop.check()


def test_a_stop_lands_between_two_decoder_layers_of_one_forward(tiny):
    """On a loaded CPU one forward pass of the default model takes many seconds: a stop must not wait it out."""
    model, tok, prompter, _, groups = tiny
    model = copy.deepcopy(model)
    stop, ran = StopRequest(), []
    layers = model.model.layers
    layers[0].register_forward_hook(lambda *_: stop.set("test"))  # the request arrives inside the forward
    layers[1].register_forward_hook(lambda *_: ran.append("layer 1"))
    trainer = Trainer(model, tok.pad_token_id, TrainConfig(), stop=stop)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RoundAbandoned):
        trainer.step(to_sequences(groups, tok, prompter, scale_std=True))
    assert ran == []  # layer 1 never ran: abandoned between the two layers
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
