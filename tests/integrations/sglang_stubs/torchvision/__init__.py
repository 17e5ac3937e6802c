"""Stand-in for torchvision in kvtier's SGLang test environment (see README.md beside it).

Every `torchvision.*` module imports (a finder makes them on demand, as transformers and SGLang
import several); every name in them is a class that raises when built or called, except
`InterpolationMode`, an enum that module-level code reads.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

from torchvision._unavailable import InterpolationMode, unavailable

__version__ = "0.0.0+kvtier-stand-in"


def _name_in(module: str, name: str) -> Any:
    if name == "InterpolationMode":
        return InterpolationMode
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable(module, name)


def __getattr__(name: str) -> Any:
    return _name_in(__name__, name)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every `torchvision.<sub>` module as an empty package of stand-in names."""

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + ".") or fullname == __name__ + "._unavailable":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: _name_in(spec.name, name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_StandInFinder())
