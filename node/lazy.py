"""Import a module only when it is first used.

A node starts in a few seconds of CPU, most of it imports, and every test and local swarm starts many. Some
of those imports serve nothing a node does: reasoning_gym imports every dataset module, and two of them
(game_of_life and its halting variant) import cellpylib, which imports matplotlib (0.7 s of CPU); three of its
subpackages import sympy; hivemind imports its averaging stack and with it scipy.optimize. A stand-in
registered under the module's name takes `import cellpylib as cpl` or `from . import algebra`; the first
attribute read from it (or `load_now`) imports the real module, which then replaces the stand-in everywhere it
is looked up (so a task mix that does use those datasets gets the real thing).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types


class _StandIn(types.ModuleType):
    def load(self) -> types.ModuleType:
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        real = importlib.import_module(name)
        self.__dict__.update(vars(real))
        return real

    def __getattr__(self, attr: str):  # only for names the stand-in lacks: all but the module basics
        return getattr(self.load(), attr)


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """`importlib.util.find_spec` without importing the parent package of a submodule."""
    parent, _, _ = name.rpartition(".")
    if not parent:
        return importlib.util.find_spec(name)
    parent_spec = _find_spec(parent)
    if parent_spec is None or parent_spec.submodule_search_locations is None:
        return None
    return importlib.machinery.PathFinder.find_spec(name, list(parent_spec.submodule_search_locations))


def import_lazily(name: str) -> None:
    """Register a stand-in for `name` (a module or a package's submodule, whose package is not imported
    here) unless it is imported already or not installed."""
    if name in sys.modules:
        return
    spec = _find_spec(name)
    if spec is None:
        return
    stand_in = _StandIn(name)
    # what a scan of sys.modules reads (inspect.getmodule reads every module's __file__; torch does it at
    # import) must not import the real module
    stand_in.__spec__, stand_in.__file__, stand_in.__loader__ = spec, spec.origin, spec.loader
    stand_in.__package__ = name if spec.submodule_search_locations is not None else name.rpartition(".")[0]
    if spec.submodule_search_locations is not None:
        stand_in.__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = stand_in


def load_now(name: str) -> None:
    """Replace the stand-in for `name`, if there is one, by the real module."""
    module = sys.modules.get(name)
    if isinstance(module, _StandIn):
        module.load()
