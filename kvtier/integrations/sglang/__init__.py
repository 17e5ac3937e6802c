"""SGLang integration: `KvtierHiCacheStorage`, kvtier as the L3 storage of SGLang's HiCache.

Every SGLang instance on a node, in any process, shares KV pages through the node's kvtier
daemon: what one backed up, another prefetches (tested with SGLang 0.5.23). Loaded by name:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1}'

SGLang's host pool is allocated in a sealed memfd the daemon maps (`plugin`, which SGLang loads
from kvtier's entry point), so pages move between it and the daemon with no engine-side copy.
See docs/integrations-sglang.md. Modules: `geometry` (host layouts as `PoolLayout`s, the
namespace; no SGLang import), `plugin` (the host-pool allocator), `backend` (the storage).
Only `plugin` and `backend` import SGLang, and only when asked for.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    # SGLang's factory finds the class with getattr(module, class_name): import SGLang only then.
    if name == "KvtierHiCacheStorage":
        from kvtier.integrations.sglang.backend import KvtierHiCacheStorage

        return KvtierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
