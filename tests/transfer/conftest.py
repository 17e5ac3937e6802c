"""Transfer test harness: one `Harness` per backend, so every copy test runs on CPU and (marked
`gpu`) on CUDA, twice there: as it comes, and with the arena pinned first and every tick moved by
copy-engine DMA (`cuda-dma`). A harness puts a pool's bytes where its backend reads them and reads
them back."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.pools.layout import PoolLayout
from kvtier.transfer import CpuBackend, DuplexLanes, PoolMemory


class Harness:
    """Builds engines and pools for one backend."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.lanes_by_key: list[DuplexLanes] = []

    def backend(self, **options: object) -> object:
        if self.kind == "cpu":
            return CpuBackend()
        from kvtier.transfer.cuda import CudaBackend

        if self.kind == "cuda-dma":
            options.setdefault("dma_run_bytes", 0)
        return CudaBackend(**options)

    def engine(self, arena: np.ndarray, **options: object) -> DuplexLanes:
        backend = self.backend(**options)
        engine = DuplexLanes(backend, arena)
        self.lanes_by_key.append(engine)
        if self.kind == "cuda-dma" and arena.nbytes:
            assert backend.wait_until_pinned(30)  # type: ignore[attr-defined]
        return engine

    def pool(self, layout: PoolLayout, data: np.ndarray) -> PoolMemory:
        if self.kind == "cpu":
            return PoolMemory(layout, data)
        import cupy

        return PoolMemory(layout, cupy.asarray(data))

    def read(self, pool: PoolMemory) -> np.ndarray:
        if self.kind == "cpu":
            return pool.base.copy()
        return pool.base.get()


def random_layout(rng: np.random.Generator) -> PoolLayout:
    """A small page-first or layer-first pool of random shape."""
    make = PoolLayout.page_first if rng.integers(2) else PoolLayout.layer_first
    return make(int(rng.integers(4, 24)), int(rng.integers(1, 5)), int(rng.choice([1, 4, 16])),
                int(rng.integers(1, 3)), int(rng.choice([8, 16, 64])),
                str(rng.choice(["bfloat16", "float32", "uint8"])))


def random_bytes(rng: np.random.Generator, num_bytes: int) -> np.ndarray:
    return rng.integers(0, 256, num_bytes, dtype=np.uint8)


def slot_offsets(rng: np.random.Generator, count: int, page_bytes: int, num_slots: int,
                 slot_bytes: int) -> np.ndarray:
    """`count` distinct random slots, sometimes runs of adjacent ones."""
    if rng.integers(2):
        start = int(rng.integers(0, num_slots - count + 1))
        return (np.arange(start, start + count) * slot_bytes).astype(np.int64)
    return (rng.choice(num_slots, count, replace=False) * slot_bytes).astype(np.int64)


def keys_for(count: int, tag: int = 0) -> list[bytes]:
    return [tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(count)]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu),
                        pytest.param("cuda-dma", marks=pytest.mark.gpu)])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """A harness for each backend; the CUDA ones skip without CuPy or a device."""
    if request.param != "cpu":
        request.getfixturevalue("cupy")  # skips without CuPy or a CUDA device
    made = Harness(request.param)
    yield made
    for engine in made.lanes_by_key:
        engine.close()


@pytest.fixture
def kit() -> object:
    """This module's helpers (test modules cannot import a conftest under importlib mode)."""
    import sys

    return sys.modules[__name__]
