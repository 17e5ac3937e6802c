"""kvtier: a per-node KV-cache memory manager for LLM inference.

Pages of attention keys and values live across tiers (`hbm`, `host`, `disk`); `PageStore` is the
in-process API, the daemon serves the same verbs to engines in other processes. Importing kvtier
never imports torch or CuPy: those belong to engines and to the CUDA path.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _package_version

try:
    __version__ = _package_version("kvtier")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
