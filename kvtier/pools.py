"""Engine pools: a client's KV pages in its own shared-memory segment, as the daemon sees them.

A `PoolLayout` says where every page's segments are: one segment per layer per K and V, at
`offset + page * page_stride + layer * layer_stride + kv * kv_stride`, each `segment_bytes` long.
That expresses a page-first layout and vLLM's per-layer `[2, num_pages, page_tokens, heads, dim]`
alike. Inside the host arena a page is always stored page-first: `[layer][K, V][segment]`.

`PoolPages` is one request's pages of a pool (`PageAccess`): stores gather a page's segments into
an arena slot with one strided copy, recalls scatter them back. Verbs: `PoolLayout.validate`,
`PoolLayout.page_view`, `PoolPages`.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import ProtocolError
from kvtier.tiers.page_rows import LaneBinding

if TYPE_CHECKING:
    from kvtier.transfer.jobs import PoolMemory

_MAX_LAYOUT_VALUE = 1 << 48  # 256 TiB: larger numbers are errors, and would overflow numpy
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1, "uint8": 1}


@dataclass(slots=True, frozen=True)
class PoolLayout:
    """Where the pages of an engine pool live, in bytes from the start of its segment."""

    num_pages: int
    num_layers: int
    page_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_stride_bytes: int
    layer_stride_bytes: int
    kv_stride_bytes: int
    offset_bytes: int = 0

    @classmethod
    def page_first(cls, num_pages: int, num_layers: int, page_tokens: int, num_kv_heads: int,
                   head_dim: int, dtype: str) -> PoolLayout:
        """`[num_pages, num_layers, 2, page_tokens, heads, dim]`: each page contiguous."""
        segment = page_tokens * num_kv_heads * head_dim * DTYPE_BYTES.get(dtype, 0)
        return cls(num_pages, num_layers, page_tokens, num_kv_heads, head_dim, dtype,
                   page_stride_bytes=num_layers * 2 * segment, layer_stride_bytes=2 * segment,
                   kv_stride_bytes=segment)

    @classmethod
    def layer_first(cls, num_pages: int, num_layers: int, page_tokens: int, num_kv_heads: int,
                    head_dim: int, dtype: str) -> PoolLayout:
        """vLLM's per-layer `[2, num_pages, page_tokens, heads, dim]`, layers back to back."""
        segment = page_tokens * num_kv_heads * head_dim * DTYPE_BYTES.get(dtype, 0)
        return cls(num_pages, num_layers, page_tokens, num_kv_heads, head_dim, dtype,
                   page_stride_bytes=segment, layer_stride_bytes=2 * num_pages * segment,
                   kv_stride_bytes=num_pages * segment)

    @property
    def segment_bytes(self) -> int:
        """Bytes of one layer's K (or V) for one page."""
        return self.page_tokens * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        return self.num_layers * 2 * self.segment_bytes

    @property
    def span_bytes(self) -> int:
        """Bytes from the segment start to one past the last byte any page touches."""
        return (self.offset_bytes + (self.num_pages - 1) * self.page_stride_bytes
                + (self.num_layers - 1) * self.layer_stride_bytes + self.kv_stride_bytes
                + self.segment_bytes)

    def validate(self, segment_size_bytes: int) -> None:
        """Check the layout is well formed and stays inside a segment of the given size.

        Raises:
            ProtocolError: naming the field that is wrong.
        """
        if self.dtype not in DTYPE_BYTES:
            raise ProtocolError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        for name in ("num_pages", "num_layers", "page_tokens", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ProtocolError(f"pool layout {name} must be at least 1")
        for name in ("page_stride_bytes", "layer_stride_bytes", "kv_stride_bytes", "offset_bytes"):
            if getattr(self, name) < 0:
                raise ProtocolError(f"pool layout {name} must not be negative")
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, int) and value >= _MAX_LAYOUT_VALUE:
                raise ProtocolError(f"pool layout {name} is {value}, beyond any real pool")
        if self.kv_stride_bytes < self.segment_bytes and self.kv_stride_bytes != 0:
            raise ProtocolError("pool layout kv_stride_bytes is smaller than one segment: "
                                "K and V would overlap")
        if self.span_bytes > segment_size_bytes:
            raise ProtocolError(f"pool layout reaches byte {self.span_bytes} but the segment "
                                f"holds {segment_size_bytes}")

    def page_view(self, segment: np.ndarray) -> np.ndarray:
        """The pool as a `[num_pages, num_layers, 2, segment_bytes]` strided uint8 view."""
        return np.lib.stride_tricks.as_strided(
            segment[self.offset_bytes :],
            shape=(self.num_pages, self.num_layers, 2, self.segment_bytes),
            strides=(self.page_stride_bytes, self.layer_stride_bytes, self.kv_stride_bytes, 1),
        )


def check_page_ids(page_ids: Sequence[int], num_pool_pages: int) -> list[int]:
    """`page_ids` as a list of ints, each inside a pool of `num_pool_pages`.

    Raises:
        ProtocolError: not a flat list of integers, or an id out of range (named).
    """
    try:
        ids = np.asarray(page_ids, dtype=np.int64)
    except (OverflowError, ValueError, TypeError):
        raise ProtocolError("page ids must be integers between 0 and the pool size") from None
    if ids.ndim != 1:
        raise ProtocolError("page ids must be a flat list of integers")
    if len(ids) and (ids.min() < 0 or ids.max() >= num_pool_pages):
        bad = int(ids[(ids < 0) | (ids >= num_pool_pages)][0])
        raise ProtocolError(f"page id {bad} is out of range: the pool has {num_pool_pages} pages")
    return ids.tolist()


class StagedPages(ABC):
    """The pages `page_ids[i]` of one pool as a `PageAccess`, given how to move one page.

    Subclasses say how one page goes out of the pool into a host buffer (`_download`) and back
    (`_upload`); stores, recalls and the staging rows that disk reads land in follow from those.
    `bind_lanes` names a transfer engine that can address the whole pool: the store then moves
    these pages through that engine's lanes, batched, instead of page by page.
    """

    pool_memory: PoolMemory | None = None  # the pool as the engine `engine_key` addresses it
    engine_key: str = ""

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

    def bind_lanes(self, engine_key: str, pool_memory: PoolMemory) -> StagedPages:
        """Let the store move these pages through engine `engine_key`; returns self."""
        self.engine_key = engine_key
        self.pool_memory = pool_memory
        return self

    def lane_binding(self) -> LaneBinding | None:
        """The engine and pool pages `bind_lanes` named, or None when unbound."""
        if self.pool_memory is None:
            return None
        return LaneBinding(self.engine_key, self.pool_memory, self.page_ids)

    def subset(self, indices: Sequence[int]) -> StagedPages:
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

    def _finish_uploads(self) -> None:
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


class PoolPages(StagedPages):
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
