"""What the scheduler tells the workers each step: which pages to recall and which to store.

Picklable plain data: in vLLM's multi-process mode it travels from the engine-core process to
the worker processes inside the scheduler output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(slots=True)
class PagePlan:
    """One request's pages to move: `keys[i]` to or from vLLM block `block_ids[i]`.

    `parent_key` is the key just before `keys[0]` in the request's chain (None at its start),
    which prefix-aware eviction policies use. `parked` (recalls only): vLLM parked the request
    for its pages, so the workers report its landing instead of waiting for it.
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    parent_key: bytes | None = None
    parked: bool = False


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """One step's plans: recalls before the forward, stores after it, and the requests vLLM
    preempted (their blocks are free again: stores still reading them must end first)."""

    loads: list[PagePlan] = field(default_factory=list)
    stores: list[PagePlan] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
