"""The host tier: one shared-memory arena carved into page slots.

The arena is created once at start-up, pre-faulted, and carved by a `SlabAllocator`, so capacity
is the arena's size and never exceeded. A metadata-only host tier (no arena) keeps the same slot
accounting for trace replay. Verbs: `view`, `copy_in`, `copy_out`, `close`; slot accounting is
`slots`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.errors import StorageError
from kvtier.pools.page_access import PageAccess
from kvtier.shm import ARENA_PREFIX, SharedSegment, new_segment_name
from kvtier.tiers.slots import SlabAllocator

# Cache-line aligned slots: copies of one page never share a line with the next page.
HOST_SLOT_ALIGNMENT = 64


class HostTier:
    """Page slots in one shared-memory arena.

    Args:
        capacity_bytes: arena size.
        chunk_bytes: allocation chunk (largest page size the arena accepts).
        with_bytes: False for a metadata-only tier (replay): slots are accounted, no memory held.
        prefault: touch the arena at start so first copies run at full speed.
    """

    def __init__(
        self, capacity_bytes: int, chunk_bytes: int, with_bytes: bool = True, prefault: bool = True
    ) -> None:
        self.slots = SlabAllocator(capacity_bytes, chunk_bytes, HOST_SLOT_ALIGNMENT)
        self.segment: SharedSegment | None = None
        self._array: np.ndarray | None = None
        if with_bytes:
            try:
                self.segment = SharedSegment.create(new_segment_name(ARENA_PREFIX),
                                                    self.slots.capacity_bytes)
            except StorageError as exc:  # say which setting to lower
                raise StorageError(f"the host tier does not fit: {exc}; choose a smaller host "
                                   f"capacity (--host-capacity, host.capacity)") from exc
            if prefault:
                self.segment.prefault()
            self._array = self.segment.array()

    @property
    def capacity_bytes(self) -> int:
        """Bytes the arena holds."""
        return self.slots.capacity_bytes

    @property
    def segment_name(self) -> str | None:
        """Name under /dev/shm that clients map read-only, or None without bytes."""
        return self.segment.name if self.segment else None

    @property
    def arena(self) -> np.ndarray | None:
        """The whole arena as a flat uint8 array (what transfer engines move to and from), or
        None without bytes."""
        return self._array

    def slot_bytes_for(self, payload_bytes: int) -> int:
        """Size of the slot a page of `payload_bytes` takes in the arena."""
        return self.slots.slot_bytes_for(payload_bytes)

    def view(self, slot: int, num_bytes: int) -> np.ndarray:
        """A writable uint8 view of `num_bytes` at slot offset `slot`."""
        return self._arena()[slot : slot + num_bytes]

    def copy_in(self, pairs: Sequence[tuple[int, int]], pages: PageAccess) -> None:
        """Copy page `index` of `pages` into each (slot, index) pair's slot."""
        pages.write_into(self._arena(), pairs, self.slots.slot_bytes_for(pages.page_bytes))

    def copy_out(self, pairs: Sequence[tuple[int, int]], pages: PageAccess) -> None:
        """Copy each (slot, index) pair's slot into page `index` of `pages`."""
        pages.read_from(self._arena(), pairs, self.slots.slot_bytes_for(pages.page_bytes))

    def _arena(self) -> np.ndarray:
        if self._array is None:
            raise StorageError("this host tier holds no bytes (metadata-only)")
        return self._array

    def close(self) -> None:
        """Unmap and unlink the arena (idempotent)."""
        self._array = None
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None
