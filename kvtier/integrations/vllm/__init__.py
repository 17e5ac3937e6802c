"""vLLM integration: `KvtierConnector`, a KV connector for vLLM's v1 engine (tested with 0.32).

Every vLLM engine on a node, in any process, shares KV pages through the node's kvtier daemon:
a prefix one engine computed, another engine (or the same engine after a restart) recalls
instead of recomputing. See docs/integrations-vllm.md. Only this package imports vLLM, and only
when the connector itself is asked for: `options` and `geometry` load without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    # vLLM finds the class with getattr(module, "KvtierConnector"): import vLLM only then.
    if name == "KvtierConnector":
        from kvtier.integrations.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
