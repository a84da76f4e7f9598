"""The reputation and verify-budget flags: defaults, env/flag sources, one-line errors, and their use."""

import pytest

from node.build import verify_config
from node.ops.config import ConfigError, load_config


def test_defaults_give_a_budget_inside_the_net_timeout():
    cfg = load_config([], env={})
    v = verify_config(cfg)
    assert v.budget_s == pytest.approx(cfg.net_timeout / 3) and v.budget_bytes == 32 * 1024 * 1024
    assert v.reputation.ban_s == 3600 and not cfg.reset_reputation and v.seed == cfg.seed


def test_flags_and_env_reach_the_verifier():
    cfg = load_config(
        ["--verify-budget-s", "2.5", "--ban-s", "60", "--reset-reputation"], env={"SAPO_VERIFY_BUDGET_MB": "4"}
    )
    v = verify_config(cfg, max_age_s=30)
    assert (v.budget_s, v.budget_bytes, v.reputation.ban_s, v.max_age_s) == (2.5, 4 * 1024 * 1024, 60, 30)
    assert cfg.reset_reputation


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--verify-budget-s", "10"], "--verify-budget-s"),  # not below --net-timeout (10)
        (["--verify-budget-s", "-1"], "--verify-budget-s"),
        (["--verify-budget-mb", "0"], "--verify-budget-mb"),
        (["--verify-budget-mb", "nan"], "--verify-budget-mb"),
        (["--ban-s", "0"], "--ban-s"),
        (["--ban-s", "inf"], "--ban-s"),
        (["--identity-tier", "4"], "--identity-tier"),
        (["--identity-tier", "-1"], "--identity-tier"),
        (["--pow-difficulty", "36", "--identity-tier", "2"], "--identity-tier"),  # 44 bits: past the 40 cap
        (["--threads", str(2**31)], "--threads"),  # torch's C int would end the node in a traceback
        (["--eval-size", "200000"], "--eval-size"),  # more than the reserved range could give: refused up front
        (["--eval-unseen-size", "20000"], "--eval-unseen-size"),
    ],
)
def test_bad_values_name_the_flag(args, flag):
    with pytest.raises(ConfigError, match=f"^{flag} "):
        load_config(args, env={})


def test_identity_tiers_are_the_ones_proof_of_work_knows():
    """The config layer may not import p2p, so its limits are literals: they must be p2p.pow's."""
    from p2p.pow import MAX_POW_DIFFICULTY, MAX_TIER, TIER_BITS

    assert load_config([], env={}).identity_tier == 1
    for tier in range(MAX_TIER + 1):
        assert (
            load_config(
                ["--identity-tier", str(tier), "--pow-difficulty", str(MAX_POW_DIFFICULTY - TIER_BITS * tier)], env={}
            ).identity_tier
            == tier
        )
    for args in (
        ["--identity-tier", str(MAX_TIER + 1)],
        ["--identity-tier", "1", "--pow-difficulty", str(MAX_POW_DIFFICULTY - TIER_BITS + 1)],
    ):
        with pytest.raises(ConfigError, match="^--identity-tier "):
            load_config(args, env={})


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--lr", "nan"], "--lr"),
        (["--temperature", "nan"], "--temperature"),
        (["--net-timeout", "inf"], "--net-timeout"),  # would remove every network timeout
        (["--max-grad-norm", "-1"], "--max-grad-norm"),  # clip_grad_norm_ would flip the gradients
        (["--seed", str(2**63)], "--seed"),
        (["--swarm", ""], "--swarm"),
        (["--seed", str(2**64)], "--seed"),
        (["--device", "cuda:abc"], "--device"),
        (["--device", "cuda:" + "9" * 5000], "--device"),  # int() refuses 4300+ digits
        (["--device", "cuda:\u0663"], "--device"),  # an Arabic-Indic 3: a digit to the regex, not to torch
    ],
)
def test_values_that_would_fail_later_or_get_us_banned_name_the_flag(args, flag):
    with pytest.raises(ConfigError, match=f"^{flag} "):
        load_config(args, env={})


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", b"node = 5\n"])
def test_an_unreadable_config_file_is_one_clear_error(tmp_path, content):
    path = tmp_path / "node.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="^--config: "):
        load_config(["--config", str(path)], env={})


@pytest.mark.parametrize(
    "line, flag", [("lr = true", "--lr"), ("temperature = false", "--temperature"), ("rounds = true", "--rounds")]
)
def test_a_boolean_in_the_config_file_for_a_number_names_the_flag(tmp_path, line, flag):
    """TOML `lr = true` is no learning rate: refused as it is for ints, never read as 1.0."""
    path = tmp_path / "node.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=f"^{flag}: invalid value"):
        load_config(["--config", str(path)], env={})


def test_group_shapes_every_receiver_refuses_are_refused_in_a_swarm_only():
    """Published, each batch would be an offence and the node banned by its swarm without an error of its own;
    a silo publishes nothing and may sample as many as it likes."""
    from node.build import build_exchange, check_fits_the_wire
    from node.learn.tasks import PRESETS

    for args, flag in ((["--generations", "33"], "--generations"), (["--num-local", "65"], "--num-local")):
        cfg = load_config([*args, "--swarm-start"], env={})
        with pytest.raises(ConfigError, match=f"^{flag} must be <= "):
            build_exchange(cfg, PRESETS["smoke"])
        check_fits_the_wire(load_config(["--generations", "32", "--num-local", "64"], env={}))
        assert build_exchange(load_config(args, env={}), PRESETS["smoke"]).__class__.__name__ == "Silo"
