"""The CPU recipe (docs/CONFIGURATION.md, "Defaults"): what an unset flag means on a CPU, and that anything set wins."""

import pytest

from node.ops.config import RECIPES, ConfigError, load_config, resolve_recipe


def test_cpu_recipe_fills_only_what_no_source_set(tmp_path):
    cfg = load_config(["--device", "cpu"], env={})
    assert (cfg.recipe, cfg.tasks, cfg.lora_rank, cfg.lr, cfg.num_local, cfg.num_external) == (
        "cpu",
        "cpu-learn",
        8,
        RECIPES["cpu"]["lr"],
        2,
        2,
    )
    assert cfg.rollout_engine == "auto" and cfg.collapse_guard and cfg.beta == RECIPES["cpu"]["beta"] > 0
    assert load_config(["--device", "cpu", "--beta", "0"], env={}).beta == 0
    assert load_config(["--device", "cpu", "--tasks", "paper", "--num-local", "4"], env={}).tasks == "paper"
    assert load_config(["--device", "cpu"], env={"SAPO_LORA_RANK": "4"}).lora_rank == 4
    toml = tmp_path / "node.toml"
    toml.write_text("lr = 3e-5\n")
    assert load_config(["--device", "cpu", "--config", str(toml)], env={}).lr == 3e-5


def test_full_fine_tuning_on_a_cpu_keeps_the_full_fine_tuning_rate():
    """The recipe's rate and KL weight are LoRA values: --lora-rank 0 gets the full fine-tuning default rate,
    not 2e-4, and no KL term (which would need a second copy of the model)."""
    cfg = load_config(["--device", "cpu", "--lora-rank", "0"], env={})
    assert cfg.lora_rank == 0 and cfg.lr == 1e-6 and cfg.beta == 0


def test_no_recipe_and_a_gpu_with_another_model_keep_the_papers_setup():
    for argv in (["--recipe", "none"], ["--device", "cuda", "--model", "Qwen/Qwen2.5-0.5B-Instruct"]):
        cfg = load_config(argv, env={})
        assert (cfg.recipe, cfg.tasks, cfg.lora_rank, cfg.lr, cfg.num_local, cfg.num_external, cfg.beta) == (
            "none",
            "paper",
            0,
            1e-6,
            4,
            4,
            0,
        )
    assert resolve_recipe("cpu", "cuda") == "cpu"  # asked for by name: taken as given


def test_a_gpu_with_a_packaged_model_takes_the_cpu_recipe():
    """The paper mix gives the small packaged models no reward to learn from; the CPU recipe learns on a GPU."""
    for model in ("default", "gemma3-270m"):
        assert load_config(["--device", "cuda:0", "--model", model], env={}).recipe == "cpu"
    assert resolve_recipe("auto", "cuda", "/models/qwen") == "none"


def test_unknown_recipe_is_one_clear_error():
    with pytest.raises(ConfigError, match="--recipe"):
        load_config(["--recipe", "fast"], env={})
