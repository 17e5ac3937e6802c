"""CUDA-only checks: the pinned, mapped arena path and a CuPy event as a store's ready condition.
The shared copy tests also run on CUDA through the `harness` fixture's `gpu` parameter."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.pools.layout import PoolLayout
from kvtier.transfer import PoolPageIds

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pinned, dma_run_bytes", [(False, 0), (True, 0), (True, 1 << 62)],
                         ids=["staged", "pinned-dma", "pinned-kernel"])
def test_store_and_recall_with_and_without_a_pinned_arena(kit, cupy, pinned: bool,
                                                          dma_run_bytes: int) -> None:
    from kvtier.transfer import DuplexLanes, PoolMemory
    from kvtier.transfer.cuda import CudaBackend

    rng = np.random.default_rng(11)
    layout = PoolLayout.layer_first(64, 4, 16, 2, 64, "bfloat16")
    data = kit.random_bytes(rng, layout.span_bytes)
    pool = PoolMemory(layout, cupy.asarray(data))
    arena = np.zeros(64 * layout.page_bytes, np.uint8)
    backend = CudaBackend(pin_arena=pinned, staging_bytes=layout.page_bytes * 3 + 64,
                          dma_run_bytes=dma_run_bytes)
    with DuplexLanes(backend, arena) as engine:
        if pinned:
            assert backend.wait_until_pinned(30)
        pages = rng.permutation(64)
        engine.submit_store(PoolPageIds(pool, pages), np.arange(64) * layout.page_bytes,
                            kit.keys_for(64)).result(30)
        view = layout.page_view(data)
        for slot, page in enumerate(pages):
            assert np.array_equal(arena[slot * layout.page_bytes : (slot + 1) * layout.page_bytes],
                                  view[page].reshape(-1))
        target = PoolMemory(layout, cupy.zeros(layout.span_bytes, cupy.uint8))
        engine.submit_recall(PoolPageIds(target, pages), np.arange(64) * layout.page_bytes,
                             kit.keys_for(64)).result(30)
        assert np.array_equal(target.base.get()[: layout.span_bytes], data)


def test_store_waits_on_a_cupy_event(kit, cupy) -> None:
    from kvtier.transfer import DuplexLanes, PoolMemory
    from kvtier.transfer.cuda import CudaBackend

    layout = PoolLayout.page_first(8, 2, 16, 1, 64, "bfloat16")
    pool = PoolMemory(layout, cupy.zeros(layout.span_bytes, cupy.uint8))
    arena = np.zeros(8 * layout.page_bytes, np.uint8)
    with DuplexLanes(CudaBackend(pin_arena=False), arena) as engine:
        writer = cupy.cuda.Stream(non_blocking=True)
        with writer:
            cupy.cuda.runtime.streamSynchronize(writer.ptr)
            pool.base.fill(7)  # the engine's write the store must not overtake
            written = cupy.cuda.Event()
            written.record(writer)
        engine.submit_store(PoolPageIds(pool, range(8)), np.arange(8) * layout.page_bytes,
                            kit.keys_for(8), ready=written).result(30)
    assert (arena == 7).all()


def test_a_failed_pinning_is_named_and_the_lanes_stage_on(kit, cupy, monkeypatch) -> None:
    from kvtier.transfer import DuplexLanes, PoolMemory
    from kvtier.transfer.cuda import CudaBackend

    def refuse(*args: object) -> None:
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    monkeypatch.setattr(cupy.cuda.runtime, "hostRegister", refuse)
    rng = np.random.default_rng(12)
    layout = PoolLayout.layer_first(16, 2, 16, 2, 64, "bfloat16")
    data = kit.random_bytes(rng, layout.span_bytes)
    pool = PoolMemory(layout, cupy.asarray(data))
    arena = np.zeros(16 * layout.page_bytes, np.uint8)
    backend = CudaBackend(pin_arena=True)
    with DuplexLanes(backend, arena) as engine:
        with pytest.raises(RuntimeError, match="AlreadyRegistered"):
            backend.wait_until_pinned(30)
        assert backend.arena_device_address is None
        engine.submit_store(PoolPageIds(pool, np.arange(16)), np.arange(16) * layout.page_bytes,
                            kit.keys_for(16)).result(30)
        assert np.array_equal(arena, np.concatenate(
            [page.reshape(-1) for page in layout.page_view(data)]))
