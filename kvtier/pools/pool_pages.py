"""A request's pages of an engine pool, as the store reads and writes them.

`PoolPageAccess` is the `PageAccess` every kind of pool shares, given how one page moves out of
and into the pool; `MappedPoolPages` is its mapped shared-memory kind (a sealed memfd pool):
stores gather a page's segments into an arena slot with one strided copy, recalls scatter them
back. The other kinds are `PoolFilePages` (below: a client's segment, by descriptor) and
`kvtier.pools.device.DevicePoolPages` (a client's GPU memory). The pool geometry (`PoolLayout`)
is `kvtier.pools.layout`. Verbs: `PoolPageAccess.bind_lanes`,
`PoolPageAccess.subset`, `MappedPoolPages`.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from kvtier.pools.layout import PoolLayout, PoolMemory, check_page_ids
from kvtier.pools.page_access import LaneBinding
from kvtier.pools.pool_file import CopyWay, PoolFile


class PoolPageAccess(ABC):
    """The pages `page_ids[i]` of one pool as a `PageAccess`, given how to move one page.

    Subclasses say how one page goes out of the pool into a host buffer (`_download`) and back
    (`_upload`); stores, recalls and the staging rows that disk reads land in follow from those.
    `bind_lanes` names a transfer engine that can address the whole pool: the store then moves
    these pages through that engine's lanes, batched, instead of page by page.
    """

    pool_memory: PoolMemory | None = None  # the pool as the engine `lanes_key` addresses it
    lanes_key: str = ""

    def __init__(self, num_pool_pages: int, page_shape: tuple[int, ...],
                 page_ids: Sequence[int]) -> None:
        self._ids = check_page_ids(page_ids, num_pool_pages)
        self.num_pages = len(self._ids)
        self._page_shape = page_shape
        self.page_bytes = int(np.prod(page_shape))
        self._staging: dict[int, np.ndarray] = {}

    @property
    def page_ids(self) -> np.ndarray:
        """The pool page id of each page, in request order."""
        return np.asarray(self._ids, dtype=np.int64)

    def bind_lanes(self, lanes_key: str, pool_memory: PoolMemory) -> PoolPageAccess:
        """Let the store move these pages through engine `lanes_key`; returns self."""
        self.lanes_key = lanes_key
        self.pool_memory = pool_memory
        return self

    def lane_binding(self) -> LaneBinding | None:
        """The engine and pool pages `bind_lanes` named, or None when unbound."""
        if self.pool_memory is None:
            return None
        return LaneBinding(self.lanes_key, self.pool_memory, self.page_ids)

    def subset(self, indices: Sequence[int]) -> PoolPageAccess:
        """Pages `indices` of these pages (same pool, same engine binding), in that order."""
        part = copy.copy(self)
        part._ids = [self._ids[i] for i in indices]
        part.num_pages = len(part._ids)
        part._staging = {}
        return part

    @abstractmethod
    def _download(self, index: int, out: np.ndarray) -> None:
        """Copy page `index` of the pool into the host buffer `out` (page_bytes, contiguous)."""

    @abstractmethod
    def _upload(self, index: int, source: np.ndarray) -> None:
        """Copy the host buffer `source` into page `index` of the pool."""

    def _finish_uploads(self) -> None:  # noqa: B027 - a hook: most pools have nothing to wait for
        """After a batch of `_upload`s: a pool whose uploads run asynchronously waits for them
        here, so the pages are in place and their sources free when the batch returns."""

    def write_into(self, arena: np.ndarray, pairs: Sequence[tuple[int, int]],
                   slot_bytes: int) -> None:
        """Pool pages into their arena slots."""
        for slot, index in pairs:
            self._download(index, arena[slot : slot + self.page_bytes])

    def read_from(self, arena: np.ndarray, pairs: Sequence[tuple[int, int]],
                  slot_bytes: int) -> None:
        """Arena slots into their pool pages."""
        for slot, index in pairs:
            self._upload(index, arena[slot : slot + self.page_bytes])
        self._finish_uploads()

    def row(self, index: int) -> np.ndarray:
        """Page `index` in a contiguous staging row (the landed bytes after `land`)."""
        staged = self._staging.get(index)
        if staged is None:
            staged = self._staging[index] = np.empty(self.page_bytes, dtype=np.uint8)
            self._download(index, staged)
        return staged

    def landing_row(self, index: int) -> np.ndarray:
        """A staging row for a disk read of page `index`."""
        staged = self._staging.get(index)
        if staged is None:
            staged = self._staging[index] = np.empty(self.page_bytes, dtype=np.uint8)
        return staged

    def land(self, indices: Sequence[int]) -> None:
        """Move the landed staging rows into their pool pages."""
        for index in indices:
            self._upload(index, self._staging[index])
        self._finish_uploads()


class MappedPoolPages(PoolPageAccess):
    """Pages of a shared-memory pool: one strided numpy copy per page each way.

    Raises:
        ProtocolError: a page id is out of range.
    """

    def __init__(self, pool_view: np.ndarray, page_ids: Sequence[int]) -> None:
        super().__init__(pool_view.shape[0], pool_view.shape[1:], page_ids)
        self._pool = pool_view

    def _download(self, index: int, out: np.ndarray) -> None:
        np.copyto(out.reshape(self._page_shape), self._pool[self._ids[index]])

    def _upload(self, index: int, source: np.ndarray) -> None:
        np.copyto(self._pool[self._ids[index]], source.reshape(self._page_shape))


class PoolFilePages(PoolPageAccess):
    """Pages `page_ids` of a `PoolFile`, moved one page per copy when no lane takes them.

    Raises:
        ProtocolError: a page id is out of range.
    """

    def __init__(self, pool_file: PoolFile, layout: PoolLayout, page_ids: Sequence[int]) -> None:
        super().__init__(layout.num_pages, (layout.page_bytes,), page_ids)
        self._file = pool_file
        self._layout = layout

    def _download(self, index: int, out: np.ndarray) -> None:
        self._file.copy_pages(CopyWay.OUT_OF_POOL, self._layout, self._ids[index], 1,
                              out.data.cast("B"), 0, self.page_bytes)

    def _upload(self, index: int, source: np.ndarray) -> None:
        self._file.copy_pages(CopyWay.INTO_POOL, self._layout, self._ids[index], 1,
                              source.data.cast("B"), 0, self.page_bytes)
