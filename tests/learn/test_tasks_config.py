"""Task specs regenerate exactly; answer extraction; config precedence flags > env > file > defaults."""

import pytest

from node.learn.tasks import PRESETS, TaskError, TaskSampler, TaskSpec, extract_answer, regenerate, resolve_mix, score
from node.ops.config import ConfigError, load_config


def test_spec_regenerates_the_same_question_and_answer():
    mix = PRESETS["cpu-easy"]
    tasks = TaskSampler(mix, seed=11).sample(6)
    for t in tasks:
        wire = t.spec.to_wire()
        again = regenerate(TaskSpec.make(wire["dataset"], wire["config"], wire["seed"], wire["index"]))
        assert (again.question, again.answer) == (t.question, t.answer)
        assert score(again, t.answer) == 1.0


def test_sampler_state_round_trip():
    a = TaskSampler(PRESETS["paper"], seed=2)
    a.sample(3)
    state = a.state_dict()
    b = TaskSampler(PRESETS["paper"], seed=2)
    b.load_state_dict(state)
    assert [t.spec for t in a.sample(5)] == [t.spec for t in b.sample(5)]


def test_mix_allows_only_its_own_datasets_and_configs():
    mix = PRESETS["cpu-easy"]
    ok = TaskSpec.make("count_bits", mix.datasets["count_bits"]["config"], 1, 1)
    assert mix.allows(ok)
    assert not mix.allows(TaskSpec.make("count_bits", {"min_n": 1, "max_n": 10**9}, 1, 1))
    assert not mix.allows(TaskSpec.make("bf", {}, 1, 1))
    # equal in Python, other content on the wire: 1.0 or true for 1 would dodge "trained on once"
    config = mix.datasets["count_bits"]["config"]
    key = next(k for k, v in config.items() if v == 1 and type(v) is int)
    for other in (1.0, True):
        assert not mix.allows(TaskSpec.make("count_bits", {**config, key: other}, 1, 1))
    with pytest.raises(TaskError):
        regenerate(TaskSpec.make("gcd", {}, 1, -1))
    with pytest.raises(TaskError):
        resolve_mix("not_a_dataset")


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer>42</answer>", "42"),
        ("thinking... <answer> 7 </answer> trailing", "7"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("<answer>5\nmore text", "5"),
        ("no tags\nfinal: 9", "final: 9"),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_config_precedence(tmp_path):
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text('lr = 0.5\nrounds = 7\ngenerations = 3\npeers = ["/ip4/127.0.0.1/tcp/1/p2p/x"]\n')
    env = {"SAPO_ROUNDS": "9", "SAPO_GENERATIONS": "5"}
    cfg = load_config(["--config", str(cfg_file), "--generations", "6"], env=env)
    assert cfg.lr == 0.5  # file
    assert cfg.rounds == 9  # env beats file
    assert cfg.generations == 6  # flag beats env
    assert cfg.peers == ["/ip4/127.0.0.1/tcp/1/p2p/x"]
    assert cfg.temperature == 1.0  # default


def test_config_errors_name_the_option(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_option = 1\n")
    with pytest.raises(ConfigError, match="no_such_option"):
        load_config(["--config", str(bad)], env={})
    with pytest.raises(ConfigError, match="--top-p"):
        load_config(["--top-p", "1.5"], env={})
    with pytest.raises(ConfigError, match="--window"):
        load_config([], env={"SAPO_WINDOW": "0"})


@pytest.mark.parametrize(
    "text, message",
    [
        ('rounds = "x"\nbogus = 1\n[node]\nlr = 0.5\n', "bogus, rounds in .* lie outside its \\[node\\] table"),
        ("[node]\nmodel = {a = 1}\n", "--model: invalid value"),
        ("[node]\nrounds = [1, 2]\n", "--rounds: invalid value"),
        ("[node]\npeers = [{a = 1}]\n", "--peers: invalid value"),
    ],
)
def test_a_config_file_that_would_be_misread_is_refused(tmp_path, text, message):
    """Options above a [node] table were ignored, and a table given for a text option became its text."""
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", str(path)], env={})


def test_a_config_file_may_hold_other_tables_beside_node(tmp_path):
    path = tmp_path / "swarm.toml"
    path.write_text('[node]\nrounds = 7\n[bootstrap]\nhost = "x"\n')
    assert load_config(["--config", str(path)], env={}).rounds == 7
    assert load_config(["--swarm-start", "--require-peers"], env={}).require_peers  # a swarm's first peer


def test_an_empty_run_dir_is_refused():
    with pytest.raises(ConfigError, match="--run-dir must name a directory"):
        load_config(["--run-dir", ""], env={})
