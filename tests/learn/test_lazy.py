"""node/lazy.py: reasoning_gym no longer drags matplotlib into every node start, and the datasets that
use cellpylib still get the real module; a scan of sys.modules (torch makes one) does not import it."""

import subprocess
import sys

from conftest import REPO

CHECK = """
import sys
import inspect
import node.learn.tasks
import reasoning_gym
inspect.getmodule(None, "/no/such/file.py")  # reads every module's __file__, as torch does at import
print("matplotlib" in sys.modules)
board = reasoning_gym.create_dataset("game_of_life", seed=1, size=1)[0]["question"]
print("Game of Life" in board, type(sys.modules["cellpylib"]).__name__, "matplotlib" in sys.modules)
"""


def test_cellpylib_is_imported_on_first_use_only():
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "module", "True"]


DEFERRED = """
import sys
import node.cli, node.loop, node.build
import hivemind
from node.learn.tasks import resolve_mix, regenerate, TaskSpec
print(sorted(m for m in ("sympy", "scipy.linalg", "matplotlib") if m in sys.modules))
mix = resolve_mix("simple_equations,chain_sum")  # simple_equations lives in reasoning_gym.algebra (sympy)
print(regenerate(TaskSpec("simple_equations", (), 3, 7)).question.startswith("Solve for"), "sympy" in sys.modules)
from hivemind.averaging.load_balancing import load_balance_peers  # scipy.optimize, loaded when used
print(load_balance_peers(10, [1.0, 1.0]))
"""


def test_a_node_start_leaves_sympy_and_scipy_optimize_until_a_dataset_or_hivemind_needs_them():
    out = subprocess.run([sys.executable, "-c", DEFERRED], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "True True", "(5, 5)"], out.stdout
