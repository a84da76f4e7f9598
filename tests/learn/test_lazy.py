"""node/learn/lazy.py: reasoning_gym no longer drags matplotlib into every node start, and the datasets that
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
