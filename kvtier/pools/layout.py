"""Pool geometry: where an engine pool's pages are, in bytes, and what addresses the pool.

A `PoolLayout` says where every page's segments are: one segment per layer per K and V, at
`offset + page * page_stride + layer * layer_stride + kv * kv_stride`, each `segment_bytes` long.
That expresses a page-first layout and vLLM's per-layer `[2, num_pages, page_tokens, heads, dim]`
alike. Inside the host arena a page is always stored page-first: `[layer][K, V][segment]`.
`PoolMemory` is a layout with the pool's base (what a transfer lane addresses).

A leaf module (it imports nothing of kvtier but errors): the client, the daemon, the transfer
lanes and the vLLM connector's geometry all build on it. Verbs: `PoolLayout.page_first`,
`PoolLayout.layer_first`, `PoolLayout.validate`, `PoolLayout.page_view`, `check_page_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ProtocolError

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
        self.check_fields()
        if self.span_bytes > segment_size_bytes:
            raise ProtocolError(f"pool layout reaches byte {self.span_bytes} but the segment "
                                f"holds {segment_size_bytes}")

    def check_fields(self) -> None:
        """Check each field is in range, before any size is computed from them.

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
        if self.kv_stride_bytes < self.segment_bytes:
            raise ProtocolError("pool layout kv_stride_bytes is smaller than one segment: "
                                "K and V would overlap")
        # A zero stride over more than one page or layer makes them all one memory: a store
        # would read one page's bytes under every key, a recall overwrite one page many times.
        for count, stride in (("num_pages", "page_stride_bytes"),
                              ("num_layers", "layer_stride_bytes")):
            if getattr(self, count) > 1 and getattr(self, stride) == 0:
                raise ProtocolError(f"pool layout {stride} is 0 with {getattr(self, count)} "
                                    f"{count.removeprefix('num_')}: they would overlap")

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


@dataclass(slots=True, frozen=True)
class PoolMemory:
    """One engine pool: its layout and where it lives.

    `base` is the pool's flat uint8 array on the CPU backend, or its device address (an int, or
    anything with `.data.ptr`, such as a CuPy array) on the CUDA backend.
    """

    layout: PoolLayout
    base: object
