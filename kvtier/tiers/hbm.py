"""The hbm tier: a daemon-owned page pool at the top of the hierarchy (hbm -> host -> disk).

Hot pages are promoted into it from the host arena; a recall that hits it copies device to device
into the engine's pool (through a transfer engine whose arena is this pool). On a GPU it is one
device allocation; without one it is a separate host-memory arena with its own capacity, so
placement across three tiers runs, and is tested, everywhere. Slots are carved by a
`SlabAllocator`, as in the host arena. Verbs: `copy_from_host`, `copy_to_host`, `copy_out`,
`close`; slot accounting is `slots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.pools.page_access import PageAccess
from kvtier.tiers.slots import SlabAllocator

# Slots on 256-byte boundaries: the gather/scatter kernels copy 16-byte vectors, and device
# allocations are 256-byte aligned, so every slot starts aligned for them.
HBM_SLOT_ALIGNMENT = 256


class HbmTier:
    """Page slots in one device allocation (GPU `device`) or, with `device` None, host memory.

    Args:
        capacity_bytes: pool size.
        chunk_bytes: allocation chunk (largest page size the pool accepts).
        device: the GPU holding the pool; None for the host-memory stand-in.
        with_bytes: False for a metadata-only tier (replay): slots are accounted, no memory held.

    Raises:
        ProtocolError: a GPU pool was asked for and CuPy is not installed.
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int, device: int | None = None,
                 with_bytes: bool = True) -> None:
        self.slots = SlabAllocator(capacity_bytes, chunk_bytes, HBM_SLOT_ALIGNMENT)
        self.device = device
        self._cupy: Any = None
        self.arena: Any = None  # numpy uint8 array, or a CuPy one on `device`
        if not with_bytes:
            return
        if device is None:
            self.arena = np.zeros(self.slots.capacity_bytes, dtype=np.uint8)  # zeros: faulted
        else:
            from kvtier.gpu import load_cupy  # imported only for a GPU pool

            self._cupy = load_cupy()
            with self._cupy.cuda.Device(device):
                self.arena = self._cupy.zeros(self.slots.capacity_bytes, dtype=self._cupy.uint8)
                self._cupy.cuda.get_current_stream().synchronize()  # zeroed before lanes use it

    @property
    def capacity_bytes(self) -> int:
        """Bytes the pool holds."""
        return self.slots.capacity_bytes

    @property
    def on_device(self) -> bool:
        """Whether the pool is GPU memory."""
        return self.device is not None

    @property
    def address(self) -> int:
        """The pool's first byte: a device address on a GPU, a host address otherwise."""
        if self._cupy is not None:
            return int(self.arena.data.ptr)
        return int(self.arena.ctypes.data)

    def copy_from_host(self, pairs: Sequence[tuple[int, int]], host_arena: np.ndarray,
                       page_bytes: int) -> None:
        """Promotion: host arena `host_slot` into `hbm_slot`, for each (hbm_slot, host_slot)."""
        if self._cupy is None:
            for hbm_slot, host_slot in pairs:
                np.copyto(self.arena[hbm_slot : hbm_slot + page_bytes],
                          host_arena[host_slot : host_slot + page_bytes])
            return
        with self._cupy.cuda.Device(self.device):
            for hbm_slot, host_slot in pairs:
                self.arena[hbm_slot : hbm_slot + page_bytes].set(
                    host_arena[host_slot : host_slot + page_bytes])
            # set() copies on the current stream, asynchronously once the host arena is pinned:
            # the pages must land before they are served (kernels run on the lanes' own streams)
            # and before their host slots can be reused.
            self._cupy.cuda.get_current_stream().synchronize()

    def copy_to_host(self, pairs: Sequence[tuple[int, int]], host_arena: np.ndarray,
                     page_bytes: int) -> None:
        """Demotion: `hbm_slot` into host arena `host_slot`, for each (hbm_slot, host_slot)."""
        for hbm_slot, host_slot in pairs:
            target = host_arena[host_slot : host_slot + page_bytes]
            if self._cupy is None:
                np.copyto(target, self.arena[hbm_slot : hbm_slot + page_bytes])
            else:
                with self._cupy.cuda.Device(self.device):
                    self.arena[hbm_slot : hbm_slot + page_bytes].get(out=target)

    def copy_out(self, pairs: Sequence[tuple[int, int]], pages: PageAccess) -> None:
        """Slot into page `index` of `pages` for each (slot, index) pair, without an engine.

        Host memory: straight from the pool. GPU: through one host staging buffer.
        """
        slot_bytes = self.slots.slot_bytes_for(pages.page_bytes)
        if self._cupy is None:
            pages.read_from(self.arena, pairs, slot_bytes)
            return
        staging = np.empty(len(pairs) * slot_bytes, dtype=np.uint8)
        self.copy_to_host([(slot, n * slot_bytes) for n, (slot, _) in enumerate(pairs)],
                          staging, pages.page_bytes)
        pages.read_from(staging, [(n * slot_bytes, index) for n, (_, index) in enumerate(pairs)],
                        slot_bytes)

    def slot_bytes_for(self, payload_bytes: int) -> int:
        """Size of the slot a page of `payload_bytes` takes in the pool."""
        return self.slots.slot_bytes_for(payload_bytes)

    def view(self, slot: int, num_bytes: int) -> np.ndarray | None:
        """The bytes of a slot as a host array: a view in host memory, a copy from a GPU."""
        if self.arena is None:
            return None
        if self._cupy is None:
            return self.arena[slot : slot + num_bytes]
        with self._cupy.cuda.Device(self.device):
            return self.arena[slot : slot + num_bytes].get()

    def close(self) -> None:
        """Release the pool (idempotent)."""
        self.arena = None
