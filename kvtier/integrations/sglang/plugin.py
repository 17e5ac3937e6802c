"""SGLang's HiCache host pool in a sealed memfd the kvtier daemon maps: the allocator and plugin.

SGLang allocates its host pool through a `HostTensorAllocator` chosen by name
(`get_allocator_from_storage`). kvtier's entry point in the `sglang.srt.plugins` group makes SGLang
run `install` early in every process; it wraps that choice so that a host pool built for the
kvtier backend (the dynamic backend with `module_path` kvtier.integrations.sglang, or the
allocator named "kvtier") is a tensor over a new sealed memfd (`kvtier.sealed_memory`): its size
can never change, so the daemon, handed the descriptor at registration, maps it and copies pages
in and out with plain memory copies (no SIGBUS possible, no copy in SGLang). No name in
/dev/shm: nothing another process could open, and nothing left behind by a killed engine. On a
GPU SGLang still pins it (cudaHostRegister works on shared mappings).
Verbs: `install`, `KvtierHostAllocator`, `host_memory`, `HostMemory`.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import mmap
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.pool_host import common

from kvtier.sealed_memory import create_sealed, map_sealed

log = logging.getLogger("sglang.kvtier." + __name__.rsplit(".", 1)[-1])

ALLOCATOR_NAME = "kvtier"
BACKEND_MODULE = "kvtier.integrations.sglang"
# Every SGLang module that imported get_allocator_from_storage by name (0.5.23).
_ALLOCATOR_USERS = tuple(f"sglang.srt.mem_cache.{name}" for name in (
    "pool_host.common", "pool_host.base", "pool_host.mha", "pool_host.mamba", "pool_host.unified",
    "memory_pool_host"))


@dataclass(frozen=True)
class HostMemory:
    """A host pool's buffer: sealed memfd `fd` (named `name` in the daemon's messages) of
    `size_bytes`, mapped here as `array`."""

    name: str
    fd: int
    size_bytes: int
    array: np.ndarray


class KvtierHostAllocator(common.HostTensorAllocator):
    """Allocates a host pool's buffer in a new sealed memfd (a fresh memfd reads as zeros); the
    descriptor is closed when the allocator is collected (the mapping lives while the tensor
    over it does)."""

    def __init__(self) -> None:
        super().__init__()
        self.memories: list[HostMemory] = []

    def allocate(self, dims: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
        if device != "cpu":
            raise ValueError(f"kvtier's host allocator allocates CPU memory, not {device!r}")
        self.dtype, self.dims = dtype, dims
        size_bytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
        name = f"kvtier-sglang-pool-{os.getpid()}-{len(self.memories)}"
        fd = create_sealed(name, size_bytes)
        weakref.finalize(self, os.close, fd)
        _, array = map_sealed(fd, size_bytes)
        array[:: mmap.PAGESIZE] = 0  # as SGLang's own allocators do: pinning needs faulted pages
        self.memories.append(HostMemory(name, fd, size_bytes, array))
        return torch.from_numpy(array).view(dtype).reshape(dims)


def host_memory(host: Any) -> HostMemory | None:
    """The sealed memfd holding host pool `host`'s whole `kv_buffer`, or None when SGLang
    allocated it elsewhere (the plugin was not loaded, or another allocator was asked for)."""
    allocator = getattr(host, "allocator", None)
    if not isinstance(allocator, KvtierHostAllocator) or len(allocator.memories) != 1:
        return None
    memory = allocator.memories[0]
    buffer = host.kv_buffer
    if (buffer.data_ptr() != memory.array.ctypes.data or not buffer.is_contiguous()
            or buffer.numel() * buffer.element_size() != memory.size_bytes):
        return None
    return memory


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
    """Make SGLang allocate kvtier-backed host pools in sealed memfds (idempotent)."""
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
    log.info("kvtier: host pools of the kvtier HiCache backend go in sealed memfds")
