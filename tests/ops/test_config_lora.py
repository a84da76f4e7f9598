"""The LoRA flags: the documented learning-rate rule (10x without an explicit --lr, from any source),
and one-line errors."""

import pytest

from node.ops.config import LORA_LR_SCALE, ConfigError, default_lr, load_config

NO_RECIPE = {"SAPO_RECIPE": "none"}  # the built-in defaults, without the CPU recipe


def test_lora_scales_the_default_learning_rate_only_when_none_is_given(tmp_path):
    full = load_config([], env=NO_RECIPE)
    assert full.lora_rank == 0 and full.lr == 1e-6
    assert (
        load_config(["--lora-rank", "8"], env=NO_RECIPE).lr
        == 1e-5
        == default_lr(8)
        == pytest.approx(full.lr * LORA_LR_SCALE)
    )
    assert load_config(["--lora-rank", "8", "--lr", "3e-6"], env=NO_RECIPE).lr == 3e-6  # explicit flag wins
    # env counts as explicit
    assert load_config([], env={**NO_RECIPE, "SAPO_LORA_RANK": "1", "SAPO_LR": "2e-6"}).lr == 2e-6
    toml = tmp_path / "node.toml"
    toml.write_text("lora_rank = 4\nlr = 5e-7\n")
    assert load_config(["--config", str(toml)], env=NO_RECIPE).lr == 5e-7  # so does the config file
    toml.write_text("lora_rank = 4\n")
    assert load_config(["--config", str(toml)], env=NO_RECIPE).lr == 1e-5


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--lora-rank", "-1"], "--lora-rank"),
        (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha"),
        (["--lora-init", "runs/a"], "--lora-init"),  # needs an adapter to load into
    ],
)
def test_bad_lora_values_name_the_flag(args, flag):
    with pytest.raises(ConfigError, match=f"^{flag} "):
        load_config(args, env=NO_RECIPE)


def test_a_peer_count_in_sapo_peers_is_named_as_local_swarms():
    """local_swarm.sh's SAPO_PEERS=5 left in a shell must not leave a bare sapo-node with a puzzling error."""
    with pytest.raises(ConfigError, match="local_swarm.sh's peer count"):
        load_config([], env={"SAPO_PEERS": "5"})
    with pytest.raises(ConfigError, match=r"multiaddrs.*'host:1'\)$"):
        load_config(["--peers", "host:1"], env={})
