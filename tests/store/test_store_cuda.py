"""PageStore on a GPU (`gpu` marker): device pool pages stored and recalled through the CUDA
engine's lanes, a rotate on one device pool, and the hbm tier in device memory, whose hits are
recalled device to device by the engine over it. The CPU backend runs the same stories in
tests/store/test_store_lanes.py and tests/tiers/test_hbm_tier.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvtier.config import DiskConfig, HbmConfig, HostConfig, StoreConfig
from kvtier.pools.layout import PoolLayout
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier
from kvtier.transfer import Direction, PoolMemory

pytestmark = pytest.mark.gpu

PAGE_BYTES = 4096
LAYOUT = PoolLayout.layer_first(32, 2, 16, 2, 16, "bfloat16")  # 4 KiB pages, fragmented


class DevicePoolForTests:
    """A pool in device memory, opened as the daemon opens a client's (no IPC in-process)."""

    def __init__(self, cupy, seed: int) -> None:
        from kvtier.gpu import device_view
        from kvtier.pools.device import MappedDevicePool

        self.cupy = cupy
        self.data = np.random.default_rng(seed).integers(0, 256, LAYOUT.span_bytes, np.uint8)
        self.array = cupy.asarray(self.data)
        cupy.cuda.get_current_stream().synchronize()  # the lanes' streams do not wait for it
        self.pool = MappedDevicePool(cupy, int(self.array.data.ptr), 0, offset=0)
        self.pool.view = device_view(cupy, self.array, LAYOUT)
        self.memory = PoolMemory(LAYOUT, self.array)

    def pages(self, ids: list[int]):
        from kvtier.pools.device import DevicePoolPages

        return DevicePoolPages(self.pool, ids).bind_lanes("cuda", self.memory)

    def page(self, page_id: int) -> np.ndarray:
        return LAYOUT.page_view(self.array.get())[page_id].reshape(-1)


@pytest.fixture
def cuda_store(cupy) -> Iterator[Callable[..., tuple[PageStore, object]]]:
    from kvtier.transfer.cuda import CudaBackend

    stores: list[PageStore] = []

    def factory(hbm_pages: int = 0) -> tuple[PageStore, object]:
        config = StoreConfig(
            hbm=HbmConfig(capacity_bytes=hbm_pages * PAGE_BYTES, chunk_bytes=PAGE_BYTES,
                          device=0),
            host=HostConfig(capacity_bytes=64 * PAGE_BYTES, chunk_bytes=PAGE_BYTES),
            disk=DiskConfig(enabled=False))
        store = PageStore(config, transfer_backend=CudaBackend(staging_bytes=3 * PAGE_BYTES))
        stores.append(store)
        return store, cupy

    yield factory
    for store in stores:
        store.close()


def test_device_pages_store_and_recall_through_the_cuda_lanes(cuda_store, namespace,
                                                              make_keys) -> None:
    store, cupy = cuda_store()
    pool, keys = DevicePoolForTests(cupy, 1), make_keys(8, seed=1)
    saved = [pool.page(p) for p in range(8)]
    assert store.store(namespace, keys, pool.pages(list(range(8)))).ok
    into = [31, 9, 20, 8, 10, 11, 12, 30]
    result = store.recall(namespace, keys, pool.pages(into))
    assert result.ok and result.tiers == [Tier.HOST] * 8
    for index, page in enumerate(into):
        assert np.array_equal(pool.page(page), saved[index])
    lanes = store.lanes_by_key["cuda"].lane_stats()
    assert lanes[Direction.D2H].bytes_moved == lanes[Direction.H2D].bytes_moved == 8 * PAGE_BYTES
    assert store.check() == []


def test_rotate_on_a_device_pool(cuda_store, namespace, make_keys) -> None:
    store, cupy = cuda_store()
    pool = DevicePoolForTests(cupy, 2)
    resumed_keys = make_keys(4, seed=2)
    assert store.store(namespace, resumed_keys, pool.pages([0, 1, 2, 3])).ok
    resumed = [pool.page(p) for p in range(4)]
    paused = [pool.page(p) for p in (4, 5, 6)]
    paused_keys = make_keys(3, seed=3)
    result = store.rotate(namespace, paused_keys, pool.pages([4, 5, 6]), resumed_keys,
                          pool.pages([6, 5, 4, 9]))
    assert result.ok, result
    for index, page in enumerate([6, 5, 4, 9]):
        assert np.array_equal(pool.page(page), resumed[index])
    assert store.recall(namespace, paused_keys, pool.pages([20, 21, 22])).ok
    assert all(np.array_equal(pool.page(20 + i), paused[i]) for i in range(3))
    assert store.check() == []


def test_hbm_in_device_memory_serves_hot_pages_device_to_device(cuda_store, namespace,
                                                                make_keys) -> None:
    store, cupy = cuda_store(hbm_pages=8)
    assert store.hbm is not None and store.hbm.on_device
    pool, keys = DevicePoolForTests(cupy, 4), make_keys(4, seed=4)
    saved = [pool.page(p) for p in range(4)]
    assert store.store(namespace, keys, pool.pages([0, 1, 2, 3])).ok
    for target in ([4, 5, 6, 7], [8, 9, 10, 11]):  # the second hit promotes them
        assert store.recall(namespace, keys, pool.pages(target)).tiers == [Tier.HOST] * 4
    result = store.recall(namespace, keys, pool.pages([15, 14, 13, 12]))
    assert result.ok and result.tiers == [Tier.HBM] * 4
    for index, page in enumerate([15, 14, 13, 12]):
        assert np.array_equal(pool.page(page), saved[index])
    assert store.hbm_lanes_by_key["cuda"].lane_stats()[Direction.H2D].bytes_moved == 4 * PAGE_BYTES
    assert store.stats().tier("hbm").num_pages == 4
    assert store.check() == []
