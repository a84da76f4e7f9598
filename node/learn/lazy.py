"""Import a module only when it is first used.

reasoning_gym imports every dataset module when it is imported, and two of them (game_of_life and its
halting variant) import cellpylib, which imports matplotlib: 0.7 s of CPU at each node start for datasets no
preset asks for. A stand-in registered under the module's name takes `import cellpylib as cpl`; the first
attribute read from it imports the real module, which then replaces the stand-in everywhere it is looked up
(so a task mix that does use those datasets gets the real thing).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


class _StandIn(types.ModuleType):
    def __getattr__(self, attr: str):  # only for names the stand-in lacks: all but the module basics
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        real = importlib.import_module(name)
        self.__dict__.update(vars(real))
        return getattr(real, attr)


def import_lazily(name: str) -> None:
    """Register a stand-in for `name` unless it is imported already or not installed."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
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
