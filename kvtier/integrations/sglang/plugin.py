"""SGLang's HiCache host pool in shared memory the kvtier daemon maps: the allocator and plugin.

SGLang allocates its host pool through a `HostTensorAllocator` chosen by name
(`get_allocator_from_storage`). kvtier's entry point in the `sglang.srt.plugins` group makes SGLang
run `install` early in every process; it wraps that choice so that a host pool built for the
kvtier backend (the dynamic backend with `module_path` kvtier.integrations.sglang, or the
allocator named "kvtier") is a tensor over a new shared-memory segment: the daemon opens that
segment as the engine's pool and copies pages in and out of it, with no copy in SGLang. On a GPU
SGLang still pins it (cudaHostRegister works on shared mappings).
Verbs: `install`, `KvtierHostAllocator`, `host_segment`.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import weakref
from typing import Any

import torch
from sglang.srt.mem_cache.pool_host import common

from kvtier.shm import SharedSegment, new_segment_name

log = logging.getLogger("sglang.kvtier." + __name__.rsplit(".", 1)[-1])

ALLOCATOR_NAME = "kvtier"
BACKEND_MODULE = "kvtier.integrations.sglang"
# Every SGLang module that imported get_allocator_from_storage by name (0.5.23).
_ALLOCATOR_USERS = tuple(f"sglang.srt.mem_cache.{name}" for name in (
    "pool_host.common", "pool_host.base", "pool_host.mha", "pool_host.mamba", "pool_host.unified",
    "memory_pool_host"))


class KvtierHostAllocator(common.HostTensorAllocator):
    """Allocates a host pool's buffer in a new shared-memory segment (fresh segments read as
    zeros); the segment's name is unlinked when the allocator is collected or the process ends."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[SharedSegment] = []

    def allocate(self, dims: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
        if device != "cpu":
            raise ValueError(f"kvtier's host allocator allocates CPU memory, not {device!r}")
        self.dtype, self.dims = dtype, dims
        size_bytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
        segment = SharedSegment.create(new_segment_name("kvtier-pool"), size_bytes)
        segment.prefault()  # as SGLang's own allocators do: pinning needs faulted pages
        weakref.finalize(self, segment.unlink)
        self.segments.append(segment)
        return torch.from_numpy(segment.array()).view(dtype).reshape(dims)


def host_segment(host: Any) -> SharedSegment | None:
    """The shared segment holding host pool `host`'s whole `kv_buffer`, or None when SGLang
    allocated it elsewhere (the plugin was not loaded, or another allocator was asked for)."""
    allocator = getattr(host, "allocator", None)
    if not isinstance(allocator, KvtierHostAllocator) or len(allocator.segments) != 1:
        return None
    segment = allocator.segments[0]
    buffer = host.kv_buffer
    if (buffer.data_ptr() != segment.array().ctypes.data or not buffer.is_contiguous()
            or buffer.numel() * buffer.element_size() != segment.size_bytes):
        return None
    return segment


def wants_kvtier_memory(allocator_type: str) -> bool:
    """Whether SGLang asks for the host allocator of a pool served by the kvtier backend."""
    if allocator_type == ALLOCATOR_NAME:
        return True
    if allocator_type != "dynamic":
        return False
    try:
        from sglang.srt.runtime_context import get_memory

        config = json.loads(get_memory().hicache_storage_backend_extra_config or "{}")
    except (ValueError, AttributeError, TypeError):  # nothing published: not a served engine
        return False
    return isinstance(config, dict) and config.get("module_path") == BACKEND_MODULE


def install() -> None:
    """Make SGLang allocate kvtier-backed host pools in shared memory (idempotent)."""
    original = common.get_allocator_from_storage
    if getattr(original, "kvtier_wrapped", False):
        return

    def get_allocator_from_storage(allocator_type: str) -> Any:
        if wants_kvtier_memory(allocator_type):
            return KvtierHostAllocator()
        return original(allocator_type)

    get_allocator_from_storage.kvtier_wrapped = True  # type: ignore[attr-defined]
    for name in _ALLOCATOR_USERS:
        module = importlib.import_module(name)
        if getattr(module, "get_allocator_from_storage", None) is original:
            setattr(module, "get_allocator_from_storage", get_allocator_from_storage)
    log.info("kvtier: host pools of the kvtier HiCache backend go in shared memory")
