"""Where a request's page bytes come from and go to: `PageAccess` and its buffer form.

The store moves bytes between its host arena and a request's pages through `PageAccess`, so the
same store code serves in-process callers (`PageRows`: numpy arrays or buffers) and engine pools
in shared memory (`kvtier.pools.pool_pages.MappedPoolPages`: strided per-layer segments).
`copy_runs` groups (slot, row) pairs whose slots and rows both advance by one page, so adjacent
pages move as one large copy instead of one copy per page. Pages of an engine pool that a transfer
engine can address say so with `lane_binding`: the store then moves them on that engine's lanes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvtier.errors import ProtocolError

if TYPE_CHECKING:
    from kvtier.pools.layout import PoolMemory


# A caller's page buffers: an array with one page per leading row, or one buffer per page.
PageBuffers = np.ndarray | Sequence[np.ndarray | memoryview | bytes]


@dataclass(slots=True, frozen=True)
class LaneBinding:
    """Pages `page_ids` of `pool`, which the transfer engine `lanes_key` addresses."""

    lanes_key: str
    pool: PoolMemory
    page_ids: np.ndarray  # pool page of each request page, in request order


class PageAccess(Protocol):
    """A request's pages, by index, as the store reads and writes them."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""

    @property
    def num_pages(self) -> int:
        """How many pages the request names."""

    def write_into(self, arena: np.ndarray, pairs: Sequence[tuple[int, int]],
                   slot_bytes: int) -> None:
        """Copy page `index` into `arena[slot:]` for each (slot, index) pair (a store)."""

    def read_from(self, arena: np.ndarray, pairs: Sequence[tuple[int, int]],
                  slot_bytes: int) -> None:
        """Copy `arena[slot:]` into page `index` for each (slot, index) pair (a recall)."""

    def row(self, index: int) -> np.ndarray:
        """Page `index` as contiguous bytes to read (after `land`, the landed bytes)."""

    def landing_row(self, index: int) -> np.ndarray:
        """A contiguous writable buffer where a verified disk read of page `index` lands."""

    def land(self, indices: Sequence[int]) -> None:
        """Move landed rows into their pages (a no-op when landing rows are the pages)."""

    def subset(self, indices: Sequence[int]) -> PageAccess:
        """Pages `indices` of these pages, in that order (same memory, same binding)."""

    def lane_binding(self) -> LaneBinding | None:
        """The engine and pool pages to move these pages with, or None: copy them here."""


@dataclass(slots=True, frozen=True)
class PageRows:
    """Page buffers: `row(i)` is page i; `block` holds all rows back to back, when they are."""

    block: np.ndarray | None
    page_bytes: int
    rows: list[np.ndarray] | None = None  # one view per page when there is no block

    @property
    def num_pages(self) -> int:
        """How many pages these rows hold."""
        if self.rows is not None:
            return len(self.rows)
        return len(self._block()) // self.page_bytes

    def row(self, index: int) -> np.ndarray:
        """Page `index` as a flat uint8 view."""
        if self.rows is not None:
            return self.rows[index]
        start = index * self.page_bytes
        return self._block()[start : start + self.page_bytes]

    def _block(self) -> np.ndarray:
        assert self.block is not None  # rows without a block are viewed one by one, in `rows`
        return self.block

    def landing_row(self, index: int) -> np.ndarray:
        """Page `index` itself: disk reads land in place."""
        return self.row(index)

    def land(self, indices: Sequence[int]) -> None:
        """Nothing to move: reads landed in the caller's buffers."""

    def subset(self, indices: Sequence[int]) -> PageRows:
        """Rows `indices` of these rows, in that order."""
        return PageRows(None, self.page_bytes, [self.row(index) for index in indices])

    def lane_binding(self) -> None:
        """None: a caller's buffers are copied in its own thread."""
        return None

    def write_into(self, arena: np.ndarray, pairs: Sequence[tuple[int, int]],
                   slot_bytes: int) -> None:
        """Copy rows into arena slots, adjacent pages as one copy."""
        page_bytes = self.page_bytes
        for slot, index, count in copy_runs(pairs, slot_bytes, self):
            if count == 1:
                np.copyto(arena[slot : slot + page_bytes], self.row(index))
            else:
                span = count * page_bytes
                np.copyto(arena[slot : slot + span],
                          self._block()[index * page_bytes : index * page_bytes + span])

    def read_from(self, arena: np.ndarray, pairs: Sequence[tuple[int, int]],
                  slot_bytes: int) -> None:
        """Copy arena slots into rows, adjacent pages as one copy."""
        page_bytes = self.page_bytes
        for slot, index, count in copy_runs(pairs, slot_bytes, self):
            if count == 1:
                np.copyto(self.row(index), arena[slot : slot + page_bytes])
            else:
                span = count * page_bytes
                np.copyto(self._block()[index * page_bytes : index * page_bytes + span],
                          arena[slot : slot + span])

    @classmethod
    def from_buffers(cls, pages: PageBuffers, num_pages: int, page_bytes: int,
                     writable: bool = False) -> PageRows:
        """View `pages` (an array with one page per leading row, or a sequence of buffers).

        Raises:
            ProtocolError: wrong count or size, a read-only output, or an output that could
                only be flattened by copying (the bytes would land in the copy).
        """
        if (isinstance(pages, np.ndarray) and pages.ndim >= 2 and pages.flags.c_contiguous
                and (pages.flags.writeable or not writable)):
            # Fast path: one view of the whole block; rows are sliced from it on demand.
            if len(pages) != num_pages:
                raise ProtocolError(f"{num_pages} keys but {len(pages)} page buffers")
            if pages.nbytes != num_pages * page_bytes:
                raise ProtocolError(f"each page buffer holds {pages.nbytes // max(1, num_pages)} "
                                    f"bytes; this namespace's pages are {page_bytes} bytes")
            return cls(pages.reshape(-1).view(np.uint8), page_bytes)
        rows = [_flat_bytes(page, index, writable) for index, page in enumerate(pages)]
        if len(rows) != num_pages:
            raise ProtocolError(f"{num_pages} keys but {len(rows)} page buffers")
        for index, row in enumerate(rows):
            if row.nbytes != page_bytes:
                raise ProtocolError(f"page buffer #{index} holds {row.nbytes} bytes; this "
                                    f"namespace's pages are {page_bytes} bytes")
        return cls(None, page_bytes, rows)


def _flat_bytes(page: np.ndarray | memoryview | bytes, index: int, writable: bool) -> np.ndarray:
    """One page buffer as a flat uint8 array sharing its memory; never a silent copy for output."""
    if not isinstance(page, np.ndarray):
        page = np.frombuffer(page, dtype=np.uint8)
    if writable and not page.flags.writeable:
        raise ProtocolError(f"output buffer #{index} is read-only")
    flat = page.reshape(-1)
    if writable and not np.may_share_memory(flat, page):  # reshape copied: bytes would land there
        raise ProtocolError(f"output buffer #{index} cannot be flattened without a copy; "
                            f"pass a contiguous array or one row per page")
    try:
        return flat.view(np.uint8)
    except ValueError:
        raise ProtocolError(f"page buffer #{index} is strided in a way that cannot be viewed as "
                            f"bytes; pass a contiguous array") from None


def copy_runs(pairs: Sequence[tuple[int, int]], slot_bytes: int, rows: PageRows
              ) -> list[tuple[int, int, int]]:
    """Group (slot, row index) pairs into (slot, row index, count) runs of adjacent pages.

    Pairs join a run only when slots are back to back (no padding between them) and the rows
    are consecutive rows of one contiguous block; otherwise every pair is a run of one.
    """
    if rows.block is None or slot_bytes != rows.page_bytes:
        return [(slot, index, 1) for slot, index in pairs]
    runs: list[tuple[int, int, int]] = []
    start_slot = start_index = count = 0
    for slot, index in pairs:
        if count and slot == start_slot + count * slot_bytes and index == start_index + count:
            count += 1
            continue
        if count:
            runs.append((start_slot, start_index, count))
        start_slot, start_index, count = slot, index, 1
    if count:
        runs.append((start_slot, start_index, count))
    return runs
