"""--eval-share: peers that start from the same weights evaluate them once; anything that differs never shares."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import run_node
from node.learn.eval_share import _CHECKS, EvalShare, _read, weights_digest
from node.learn.evaluate import EvalResult
from node.learn.lora import attach
from node.learn.model_io import load_model
from node.learn.stop import RoundAbandoned, StopRequest
from node.ops.metrics import read_records


def result(acc: float) -> EvalResult:
    unseen = EvalResult(accuracy=acc / 2, size=2, scores=[0.0, acc], answers=["1", None], datasets=["a", "a"])
    return EvalResult(accuracy=acc, by_dataset={"a": acc}, size=2, baseline=0.5, unseen=unseen, engine="torch")


class Counting:
    def __init__(self, value: EvalResult, seconds: float = 0.0):
        self.value, self.seconds, self.calls = value, seconds, 0
        self.lock = threading.Lock()

    def __call__(self) -> EvalResult:
        with self.lock:
            self.calls += 1
        time.sleep(self.seconds)
        return self.value


def test_peers_with_the_same_weights_evaluate_once_and_read_the_same_result(tmp_path):
    model = torch.nn.Linear(4, 3)
    share = EvalShare(tmp_path, "spec", poll_s=0.01)
    compute = Counting(result(0.25), seconds=0.3)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: share.evaluate(model, compute, None), range(4)))
    assert compute.calls == 1
    assert all(g == result(0.25) for g in got)  # the unseen set's result too, through the file
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.tmp"))


def test_other_weights_or_another_spec_never_share(tmp_path):
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    first, second, third = Counting(result(0.1)), Counting(result(0.9)), Counting(result(0.5))
    assert EvalShare(tmp_path, "spec").evaluate(a, first, None).accuracy == 0.1
    assert EvalShare(tmp_path, "spec").evaluate(b, second, None).accuracy == 0.9
    assert EvalShare(tmp_path, "other evaluator").evaluate(a, third, None).accuracy == 0.5
    assert (first.calls, second.calls, third.calls) == (1, 1, 1)
    with torch.no_grad():
        b.weight.copy_(a.weight), b.bias.copy_(a.bias)
    assert weights_digest(a) == weights_digest(b)


def test_a_fresh_lora_adapter_acts_as_its_base_until_it_learns():
    model, _ = load_model("tiny-random", torch.device("cpu"))
    base = weights_digest(model)
    adapter = attach(model, 4, 8)
    assert weights_digest(adapter.model) == base  # B = 0: the same answers as the base
    with torch.no_grad():
        next(p for n, p in adapter.model.named_parameters() if "lora_B" in n).add_(0.01)
    assert weights_digest(adapter.model) != base


def test_a_dead_holder_is_taken_over_and_a_stop_ends_the_wait(tmp_path):
    model = torch.nn.Linear(4, 3)
    share = EvalShare(tmp_path, "spec", poll_s=0.01)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key_probe = Counting(result(0.3))
    share.evaluate(model, key_probe, None)  # learn the file names
    (done,) = tmp_path.glob("*.json")
    done.unlink()
    lock = done.with_suffix(".lock")
    lock.write_text(str(dead.pid))  # a peer that took the lock and died
    compute = Counting(result(0.4))
    assert share.evaluate(model, compute, None).accuracy == 0.4 and compute.calls == 1
    done.unlink()
    lock.write_text("1")  # held by a live process that never finishes
    stop = StopRequest()
    threading.Timer(0.2, stop.set, args=("test",)).start()
    t0 = time.monotonic()
    with pytest.raises(RoundAbandoned):
        share.evaluate(model, Counting(result(0.5)), stop)
    assert time.monotonic() - t0 < 5
    done.write_text("not json")  # a broken result file is computed again, not trusted
    lock.unlink()
    assert share.evaluate(model, Counting(result(0.6)), None).accuracy == 0.6
    done.unlink()
    lock.write_text(str(2**40))  # a corrupt lock: no process has that pid (os.kill raises OverflowError)
    assert share.evaluate(model, Counting(result(0.7)), None).accuracy == 0.7


MALFORMED = [
    {"unseen": 5},
    "x",
    [1],
    None,
    5,
    {},
    {"accuracy": "high"},
    {"accuracy": True},
    {"accuracy": 0.5, "scores": "abc"},
    {"accuracy": 0.5, "by_dataset": [1]},
    {"accuracy": 0.5, "size": 2.5},
    {"accuracy": 0.5, "answers": [1]},
    {"accuracy": 0.5, "unseen": {"accuracy": [1]}},
    {"accuracy": 0.5, "unseen": "x"},
    {"accuracy": 0.5, "extra": 1},
]


@pytest.mark.parametrize("content", MALFORMED, ids=[json.dumps(c) for c in MALFORMED])
def test_a_result_file_of_the_wrong_shape_is_as_good_as_absent(tmp_path, caplog, content):
    """Valid JSON that is no evaluation result: never raised, never trusted; the peer evaluates itself (its
    result replaces the file), with a warning naming the file (once, though a waiter reads it every poll)."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(content))
    with caplog.at_level(logging.WARNING, logger="node.learn.eval_share"):
        assert _read(path) is None
    assert str(path) in caplog.text
    model = torch.nn.Linear(4, 3)
    share = EvalShare(tmp_path / "share", "spec")
    share.evaluate(model, Counting(result(0.1)), None)  # learn the file name
    (done,) = (tmp_path / "share").glob("*.json")
    done.write_text(json.dumps(content))
    compute = Counting(result(0.7))
    assert share.evaluate(model, compute, None) == result(0.7) and compute.calls == 1
    assert share.evaluate(model, Counting(result(0.2)), None) == result(0.7)  # the file is whole again
    warned: set = set()
    path.write_text(json.dumps(content))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="node.learn.eval_share"):
        assert _read(path, warned) is None and _read(path, warned) is None
    assert caplog.text.count(str(path)) == 1


def test_every_field_of_a_result_is_checked_when_read():
    assert set(_CHECKS) == {f.name for f in dataclasses.fields(EvalResult)}


@pytest.mark.slow
def test_two_real_nodes_evaluate_their_common_start_once(tmp_path, tiny_args):
    """Two sapo-node processes, the tiny model, one shared directory: one evaluates the starting weights, the
    other reads its result; both records carry the same start figures; with --no-eval-round0 and --eval-at 1
    the next evaluations are after rounds 1 and 2 (the last), none after round 0."""
    args = [*tiny_args[:-2], "--rounds", "3", "--eval-every", "10", "--eval-size", "8", "--eval-share", str(tmp_path)]
    args += ["--eval-at", "1", "--no-eval-round0"]  # the quick start's schedule: start, 1, then the last
    runs = [tmp_path / "peer0", tmp_path / "peer1"]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda d: run_node(*args, "--run-dir", str(d), "--seed", d.name[-1]), runs))
    for proc in done:
        assert proc.returncode == 0, proc.stderr[-3000:]
    records = [read_records(d / "metrics.jsonl") for d in runs]
    firsts = [recs[0] for recs in records]
    assert firsts[0]["start_scores"] == firsts[1]["start_scores"] and "start_accuracy" in firsts[0]
    evaluated = [[r["round"] for r in recs if "eval_accuracy" in r] for recs in records]
    assert evaluated == [[1, 2], [1, 2]] and firsts[0]["eval_next"] == 1
    logs = [(d / "node.log").read_text() for d in runs]
    assert sum("another peer's" in log for log in logs) == 1, logs
