"""A newcomer's first commands: `--help` and `--version` of every console script, and the docs' promises.

The scripts run as real subprocesses (argparse formats help lazily: a bare `%` in one help string only
fails when --help is printed). The options table of docs/CONFIGURATION.md and the `SAPO_<NAME>` variables
that README.md and docs/*.md name are parsed here, so a later edit of the docs or of a parser that makes
them disagree fails a test.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from node import __version__
from node.ops.config import CHOICES, RECIPES, NodeConfig, build_parser, load_config

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]  # name -> "module:function"
CONFIGURATION = (REPO / "docs" / "CONFIGURATION.md").read_text()
# what a user reads: the README and the top-level docs (not the experiment and benchmark notes)
USER_DOCS = "".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """The console script as a new process, importing this checkout (as an editable install would)."""
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {func}; sys.exit({func}())"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", COLUMNS="100")
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def parser_of(name: str):
    """Each console script's module exposes build_parser(): the parser its main() uses."""
    module = importlib.import_module(SCRIPTS[name].split(":")[0])
    assert hasattr(module, "build_parser"), f"{name}: its module has no build_parser() for this test to check"
    return module.build_parser()


def test_every_console_script_is_checked():
    assert {"sapo-node", "sapo-bootstrap", "sapo-experiment", "sapo-report", "sapo-export", "sapo-ask"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_exits_0_and_lists_every_option(name):
    done = run_script(name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {name}"), done.stdout[:200]
    options = [s for action in parser_of(name)._actions for s in action.option_strings]
    assert "--version" in options
    missing = [o for o in options if o not in done.stdout]
    assert not missing, f"{name} --help does not show {missing}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_version_exits_0(name):
    done = run_script(name, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{name} {__version__}"
    assert __version__ == PYPROJECT["project"]["version"]


# --- the options table of docs/CONFIGURATION.md ---------------------------------------------------------------------

# Prose the table uses for a default, and the values it stands for.
WORDS = {
    "off": (False, 0, ""),
    "on": (True,),
    "–": ([], ""),
    "all cores": (0,),
    "mix default": (0,),
    "`--net-timeout`/3": (0.0,),
}


def config_rows() -> list[tuple[str, str]]:
    """(flags cell, default cell) of each row of the table under '## Options' in docs/CONFIGURATION.md."""
    section = CONFIGURATION.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip("|").split(" | ")] for line in section.splitlines() if line.startswith("| `--")
    ]
    return [(cells[0], cells[1]) for cells in rows]


def flags_of(cell: str) -> list[str]:
    return re.findall(r"`(--[a-z0-9-]+)`", cell)


def config_table() -> list[tuple[list[str], list[str]]]:
    """(flags, defaults) of each row of the options table."""
    out = []
    for flag_cell, default in config_rows():
        flags, default = flags_of(flag_cell), RECIPE_NOTE.sub("", default)  # the recipe's values: own test below
        sep = " / " if " / " in default and " / " in flag_cell else ", "
        defaults = [d.strip() for d in default.split(sep)] if len(flags) > 1 else [default.strip()]
        out.append((flags, defaults))
    return out


def stated(text: str) -> tuple:
    """The values a table's default stands for: a word, or a number (units dropped), or a `literal`."""
    if text in WORDS:
        return WORDS[text]
    plain = text.strip("`").removesuffix(" s")
    try:
        return (float(plain),)
    except ValueError:
        return (plain,)


RECIPE_NOTE = re.compile(r" ?\(CPU recipe: ([^)]*)\)")


def test_readme_table_states_the_cpu_recipe_where_it_sets_a_flag():
    """Where the CPU recipe (the default on a CPU) sets a flag of the table, the row's default says so, with the
    recipe's value."""
    recipe, seen = RECIPES["cpu"], set()
    for flag_cell, default in config_rows():
        flags = flags_of(flag_cell)
        set_here = [n for n in (f[2:].replace("-", "_") for f in flags) if n in recipe and n != "recipe"]
        note = RECIPE_NOTE.search(default)
        assert bool(note) == bool(set_here), f"{flags}: the recipe sets {set_here}; the row says {default!r}"
        if note:  # the recipe's numbers in the row's flag order, its words anywhere in the note
            numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", note.group(1))]
            assert numbers == [recipe[n] for n in set_here if not isinstance(recipe[n], str)], (
                f"{flags}: the recipe sets {[(n, recipe[n]) for n in set_here]}; the row says {note.group(0)!r}"
            )
            assert all(recipe[n] in note.group(1) for n in set_here if isinstance(recipe[n], str)), note.group(0)
            seen.update(set_here)
    assert seen == set(recipe), f"the table states no recipe value for {set(recipe) - seen}"


def test_readme_table_is_parsed():
    rows = config_table()
    assert len(rows) >= 15 and sum(len(flags) for flags, _ in rows) >= 30


@pytest.mark.parametrize("flags,defaults", config_table(), ids=lambda v: ",".join(v) if isinstance(v, list) else v)
def test_readme_config_flags_exist_with_their_default(flags, defaults):
    options = {s for action in build_parser()._actions for s in action.option_strings}
    config = NodeConfig()
    names = {f.name for f in fields(NodeConfig)}
    assert len(flags) == len(defaults), f"{flags}: the table states {len(defaults)} defaults: {defaults}"
    for flag, text in zip(flags, defaults):
        assert flag in options, f"docs/CONFIGURATION.md names {flag}, which sapo-node does not have"
        name = flag[2:].replace("-", "_")
        assert name in names
        actual = getattr(config, name)
        if isinstance(actual, list) and text.startswith("`"):
            actual = " ".join(actual)
        assert any(actual == v and type(actual) is not bool or actual is v for v in stated(text)), (
            f"docs/CONFIGURATION.md says {flag} defaults to {text!r}; the parser's default is {actual!r}"
        )


def other_value(name: str) -> str:
    """A valid value for option `name` that differs from its default, as an env var would spell it."""
    default = getattr(NodeConfig(), name)
    if name in CHOICES:
        return next(c for c in CHOICES[name] if c != default)
    if isinstance(default, bool):
        return "0" if default else "1"
    if isinstance(default, list):
        return "/ip4/127.0.0.1/tcp/1"
    if isinstance(default, (int, float)):
        return str(default + (1 if name == "identity_tier" else 3))  # tiers go up to 3
    return {"device": "cpu", "practise": "chain_sum"}.get(name, default + "-x")


def test_readme_env_vars_are_read():
    """Every SAPO_<NAME> the README or a top-level doc names is a node option that load_config reads, a setting
    that one of the shell scripts they document reads (local_swarm.sh, setup.sh, test.sh, container/build.sh), or
    one the package reads from the environment by name (e.g. SAPO_MODEL_CACHE, where packaged models are
    assembled), or the suite's process starter (tests/forkserver.py)."""
    script = "".join(
        (REPO / "scripts" / f).read_text() for f in ("local_swarm.sh", "setup.sh", "test.sh", "container/build.sh")
    )
    code = "".join(p.read_text() for p in [*(REPO / "node").rglob("*.py"), REPO / "tests" / "forkserver.py"])
    names = sorted(set(re.findall(r"\bSAPO_[A-Z][A-Z0-9_]*\b", USER_DOCS)))
    assert "SAPO_NUM_LOCAL" in names and "SAPO_RUN_ROOT" in names
    option = {f"SAPO_{f.name.upper()}": f.name for f in fields(NodeConfig)}
    for env in names:
        if re.search(r"\$\{?" + env + r"\b", script) or re.search(r"environ[^\n]*[\"']" + env + r"[\"']", code):
            continue
        assert env in option, (
            f"the docs name {env}; neither sapo-node nor scripts/{{local_swarm,setup,test}}.sh reads it"
        )
        name = option[env]
        raw = other_value(name)
        assert getattr(load_config([], env={env: raw}), name) != getattr(NodeConfig(), name), env
    for name in ("num_local", "tensorboard", "peers", "model"):  # the reading itself, for every kind of option
        env = f"SAPO_{name.upper()}"
        assert getattr(load_config([], env={env: other_value(name)}), name) != getattr(NodeConfig(), name), env


def test_help_and_config_checks_do_not_import_torch():
    """`sapo-node --help` and the config checks answer at once: the allowed values come from torch-free
    node/learn/choices.py, not from the modules that implement them."""
    code = (
        "import sys\nfrom node.cli import main\nfrom node.ops.config import load_config\n"
        "load_config(['--loss-type', 'dapo', '--ij-policy', 'ema', '--rollout-engine', 'llama'], env={})\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'hivemind') if m in sys.modules)\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr, done.stderr[-500:]


def test_allowed_values_have_one_source():
    """config checks a flag against the very list the implementation uses (the engines' lists likewise come
    from node/learn/choices.py)."""
    from node.learn import grpo, precision, prefix
    from node.swarm import ij_controller

    assert CHOICES["loss_type"] is grpo.LOSS_TYPES
    assert CHOICES["prefix_sharing"] is prefix.PREFIX_SHARING
    assert CHOICES["mixed_precision"] is precision.MIXED_PRECISION
    assert CHOICES["ij_policy"] is ij_controller.CONTROLLER_NAMES
