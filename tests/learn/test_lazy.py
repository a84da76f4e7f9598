"""node/learn/lazy.py: reasoning_gym no longer drags matplotlib into every node start, and the datasets that
use cellpylib still get the real module."""

import subprocess
import sys

from conftest import REPO

CHECK = """
import sys
import node.learn.tasks
import reasoning_gym
print("matplotlib" in sys.modules)
board = reasoning_gym.create_dataset("game_of_life", seed=1, size=1)[0]["question"]
print("Game of Life" in board, type(sys.modules["cellpylib"]).__name__, "matplotlib" in sys.modules)
"""


def test_cellpylib_is_imported_on_first_use_only():
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "module", "True"]
