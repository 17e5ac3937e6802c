"""The host tier: one shared-memory arena carved into page slots.

The arena is created once at start-up, pre-faulted, and carved by a `SlabAllocator`, so capacity
is the arena's size and never exceeded. A metadata-only host tier (no arena) keeps the same slot
accounting for trace replay. A chunk whose pages all went (deleted, evicted) gives its memory
back (`release_idle_chunk`: a hole punched in /dev/shm, so the system has it again, not only the
daemon's RSS); before it is carved again it is allocated anew and, when the arena is pre-faulted,
touched, so copies into it still run at full speed, and a /dev/shm with no room for it leaves the
chunk unused instead of a SIGBUS later. Verbs: `view`, `copy_in`, `copy_out`,
`release_idle_chunk`, `close`; slot accounting is `slots`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvtier.errors import StorageError
from kvtier.pools.page_access import PageAccess
from kvtier.shm import ARENA_PREFIX, SHM_DIR, SharedSegment, new_segment_name
from kvtier.tiers.slots import SlabAllocator, align_up

# Cache-line aligned slots: copies of one page never share a line with the next page.
HOST_SLOT_ALIGNMENT = 64
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


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
        self.slots = SlabAllocator(capacity_bytes, chunk_bytes, HOST_SLOT_ALIGNMENT,
                                   self._reserve_chunk if with_bytes else None)
        self.segment: SharedSegment | None = None
        self._array: np.ndarray | None = None
        self._prefault = prefault
        self._fd = -1  # the arena's file, to punch idle chunks out of and allocate them again
        if with_bytes:
            try:
                self.segment = SharedSegment.create(new_segment_name(ARENA_PREFIX),
                                                    self.slots.capacity_bytes)
            except StorageError as exc:  # say which setting to lower
                raise StorageError(f"the host tier does not fit: {exc}; choose a smaller host "
                                   f"capacity (--host-capacity, host.capacity)") from exc
            self._fd = _open_own_file(self.segment)
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

    def release_idle_chunk(self, idle_for_s: float = 0.0) -> bool:
        """Give the memory of one chunk whose slots have all been free for `idle_for_s` back to
        the system; False when no such chunk is left. Call it under the store's lock (the
        allocator's)."""
        if self._fd < 0:
            return False
        chunk_id = self.slots.take_idle_chunk(idle_for_s)
        if chunk_id is None:
            return False
        start, num_bytes = self._chunk_pages(chunk_id)
        if num_bytes and _fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                                    start, num_bytes) != 0:
            errno = ctypes.get_errno()
            raise StorageError(f"cannot give host arena memory back: {os.strerror(errno)}")
        return True

    def _reserve_chunk(self, chunk_id: int) -> bool:
        """Allocate a released chunk's memory again (and touch it, for a pre-faulted arena);
        False when /dev/shm has no room for it."""
        start, num_bytes = self._chunk_pages(chunk_id)
        if not num_bytes:
            return True
        try:
            os.posix_fallocate(self._fd, start, num_bytes)
        except OSError:
            return False
        if self._prefault:
            self._arena()[start : start + num_bytes : mmap.PAGESIZE] = 0
        return True

    def _chunk_pages(self, chunk_id: int) -> tuple[int, int]:
        """(start, bytes) of the whole memory pages inside chunk `chunk_id`."""
        chunk_bytes = self.slots.chunk_bytes
        start = align_up(chunk_id * chunk_bytes, mmap.PAGESIZE)
        end = (chunk_id + 1) * chunk_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        return start, max(0, end - start)

    def _arena(self) -> np.ndarray:
        if self._array is None:
            raise StorageError("this host tier holds no bytes (metadata-only)")
        return self._array

    def close(self) -> None:
        """Unmap and unlink the arena (idempotent)."""
        self._array = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None


def _open_own_file(segment: SharedSegment) -> int:
    """A read-write descriptor of the file `segment` mapped, checked to be that very file."""
    fd = os.open(SHM_DIR / segment.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != segment.inode:
        os.close(fd)
        raise StorageError(f"shared-memory segment {segment.name} was replaced under the daemon")
    return fd


_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_fallocate.restype = ctypes.c_int
