"""kvtier: a per-node KV-cache memory manager for LLM inference.

Pages of attention keys and values live across tiers (`hbm`, `host`, `disk`); `PageStore` is the
in-process API, the daemon serves the same verbs to engines in other processes, which attach
with `Client` or `AsyncClient` and keep their pages in a `SharedPool` or `DeviceMemory` laid out
as a `PoolLayout`. Keys: `Namespace`, `prefix_keys`; errors: `KvtierError` and its kinds.

The public names below load on first use, so `import kvtier` stays cheap, and it never imports
torch or CuPy: those belong to engines and to the CUDA path.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version
from typing import TYPE_CHECKING, Any

try:
    __version__ = _package_version("kvtier")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

if TYPE_CHECKING:
    from kvtier.client import (
        AsyncClient,
        Client,
        DeviceMemory,
        JobResult,
        LookupReply,
        PoolHandle,
        RotateResult,
        SharedPool,
    )
    from kvtier.config import StoreConfig
    from kvtier.errors import (
        BackendUnavailableError,
        CapacityError,
        ConfigError,
        DaemonReplyError,
        KvtierError,
        ProtocolError,
        QuotaError,
        StorageError,
        TransferError,
        UntrustedServerError,
    )
    from kvtier.keys import KEY_BYTES, Namespace, prefix_keys
    from kvtier.pools.layout import PoolLayout
    from kvtier.store.page_store import PageStore

_NAME_TO_MODULE = {
    **dict.fromkeys(["AsyncClient", "Client", "DeviceMemory", "JobResult", "LookupReply",
                     "PoolHandle", "RotateResult", "SharedPool"], "kvtier.client"),
    "StoreConfig": "kvtier.config",
    **dict.fromkeys(["BackendUnavailableError", "CapacityError", "ConfigError",
                     "DaemonReplyError", "KvtierError", "ProtocolError",
                     "QuotaError", "StorageError", "TransferError", "UntrustedServerError"],
                    "kvtier.errors"),
    **dict.fromkeys(["KEY_BYTES", "Namespace", "prefix_keys"], "kvtier.keys"),
    "PoolLayout": "kvtier.pools.layout",
    "PageStore": "kvtier.store.page_store",
}

__all__ = ["__version__", *sorted(_NAME_TO_MODULE)]


def __getattr__(name: str) -> Any:
    # PEP 562: a public name is imported from its module the first time it is asked for.
    module = _NAME_TO_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAME_TO_MODULE})
