"""Names that exist so SGLang's multimodal modules import; any use raises."""

from __future__ import annotations

import enum
from typing import Any, NoReturn


class InterpolationMode(enum.Enum):
    """torchvision's interpolation modes, by name (referenced at import time)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def unavailable(module: str, name: str) -> type:
    """A class standing for `module.name`: subclassing it works, calling or building it raises."""

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{module}.{name} is not available: this environment has a "
                                  "stand-in for torchvision (kvtier's SGLang test environment)")

    return type(name, (), {"__init__": refuse, "__call__": refuse, "__module__": module})
