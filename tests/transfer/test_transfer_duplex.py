"""Both lanes at once from several threads; rotate with a slot swapped out and in; an injected
copy failure names exactly its keys; the staging ring never hands out a buffer in flight."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtier.errors import TransferError
from kvtier.pools.layout import PoolLayout
from kvtier.transfer import CpuBackend, DuplexLanes, PoolMemory, PoolPageIds, StagingRing, Swap
from kvtier.transfer.cpu import CpuMover


@pytest.mark.parametrize("make", [PoolLayout.page_first, PoolLayout.layer_first])
def test_stores_and_recalls_from_several_threads_all_land(harness, kit, make,
                                                         run_threads) -> None:
    rng = np.random.default_rng(3)
    layout = make(32, 3, 4, 2, 16, "bfloat16")
    source = kit.random_bytes(rng, layout.span_bytes)
    src_pool = harness.pool(layout, source.copy())
    dst_pool = harness.pool(layout, np.zeros(layout.span_bytes, np.uint8))
    half = 32 * layout.page_bytes
    arena = np.zeros(2 * half, np.uint8)
    arena[half:] = kit.random_bytes(rng, half)  # recalls read the upper half, stores fill the lower
    upper = arena[half:].copy()
    engine = harness.engine(arena)

    def worker(first: int) -> None:
        for page in range(first, 32, 4):
            store = engine.submit_store(PoolPageIds(src_pool, [page]),
                                        [page * layout.page_bytes], kit.keys_for(1, page))
            recall = engine.submit_recall(PoolPageIds(dst_pool, [page]),
                                          [half + page * layout.page_bytes],
                                          kit.keys_for(1, 100 + page))
            store.result(60)
            recall.result(60)

    run_threads(worker, range(4), timeout_s=60)
    view = layout.page_view(source)
    assert np.array_equal(arena[:half].reshape(32, -1), view.reshape(32, -1))
    assert np.array_equal(layout.page_view(harness.read(dst_pool)).reshape(32, -1),
                          upper.reshape(32, -1))
    assert np.array_equal(harness.read(src_pool), source)


def test_rotate_swaps_a_slot_out_before_swapping_it_in(kit, monkeypatch) -> None:
    """Page 1 goes out to slot A while slot B comes into page 1: the swap-in waits for it."""
    rng = np.random.default_rng(5)
    layout = PoolLayout.layer_first(8, 2, 4, 1, 16, "bfloat16")
    data = kit.random_bytes(rng, layout.span_bytes)
    pool = PoolMemory(layout, data)
    before = data.copy()
    page_bytes = layout.page_bytes
    arena = kit.random_bytes(rng, 8 * page_bytes)
    arena_before = arena.copy()
    slow_copy = CpuMover._copy

    def slow_stores(self, *args):  # without the dependency the swap-in would land first
        if self.direction.value == "d2h":
            time.sleep(0.05)
        slow_copy(self, *args)

    monkeypatch.setattr(CpuMover, "_copy", slow_stores)
    with DuplexLanes(CpuBackend(), arena) as engine:
        rotation = engine.rotate(
            Swap(PoolPageIds(pool, [1, 5]), [0, 3 * page_bytes], kit.keys_for(2, 1)),
            Swap(PoolPageIds(pool, [1, 6]), [4 * page_bytes, 5 * page_bytes],
                 kit.keys_for(2, 2)))
        rotation.result(60)
        independent = [job for job in rotation.swap_in_jobs if job.ready is None]
        assert independent and independent[0].page_ids.tolist() == [6]
    view = layout.page_view(before)
    assert np.array_equal(arena[:page_bytes], view[1].reshape(-1))
    assert np.array_equal(arena[3 * page_bytes : 4 * page_bytes], view[5].reshape(-1))
    after = layout.page_view(data)
    assert np.array_equal(after[1].reshape(-1), arena_before[4 * page_bytes : 5 * page_bytes])
    assert np.array_equal(after[6].reshape(-1), arena_before[5 * page_bytes : 6 * page_bytes])
    for page in (0, 2, 3, 4, 5, 7):
        assert np.array_equal(after[page], view[page])


def test_injected_copy_failure_names_exactly_its_keys(kit, monkeypatch) -> None:
    layout = PoolLayout.page_first(16, 2, 4, 1, 16, "bfloat16")
    pool = PoolMemory(layout, kit.random_bytes(np.random.default_rng(9), layout.span_bytes))
    arena = np.zeros(16 * layout.page_bytes, np.uint8)
    real_copy = CpuMover._copy

    def failing(self, pool_, first_page, first_slot, stride, count):
        if first_page <= 5 < first_page + count:
            raise OSError("injected: page 5 is unreadable")
        real_copy(self, pool_, first_page, first_slot, stride, count)

    monkeypatch.setattr(CpuMover, "_copy", failing)
    gate = threading.Event()
    with DuplexLanes(CpuBackend(), arena) as engine:
        blocker = engine.submit_store(PoolPageIds(pool, [15]), [15 * layout.page_bytes],
                                      kit.keys_for(1, 9), ready=gate)
        keys_a, keys_b = kit.keys_for(4, 1), kit.keys_for(4, 2)
        job_a = engine.submit_store(PoolPageIds(pool, [0, 1, 2, 3]),
                                    [i * layout.page_bytes for i in range(4)], keys_a)
        job_b = engine.submit_store(PoolPageIds(pool, [4, 5, 6, 7]),
                                    [i * layout.page_bytes for i in range(4, 8)], keys_b)
        assert job_a.result(60) == keys_a
        with pytest.raises(TransferError) as caught:
            job_b.result(60)
        assert caught.value.failed_keys == [keys_b[1]]
        assert "injected" in str(caught.value)
        assert not blocker.done()  # held by its ready event
        gate.set()
        blocker.result(60)
    moved = [0, 1, 2, 3, 4, 6, 7, 15]
    view = layout.page_view(pool.base)
    for page in moved:
        assert np.array_equal(arena[page * layout.page_bytes : (page + 1) * layout.page_bytes],
                              view[page].reshape(-1))
    assert not arena[5 * layout.page_bytes : 6 * layout.page_bytes].any()


class SlowFence:
    """A fake DMA: completes `delay_s` after it was released, then frees its buffer."""

    def __init__(self, index: int, in_flight: set[int], delay_s: float) -> None:
        self.index, self.in_flight = index, in_flight
        self.done_at = time.monotonic() + delay_s

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.done_at - time.monotonic()))
        self.in_flight.discard(self.index)


def test_staging_ring_never_hands_out_a_buffer_in_flight() -> None:
    ring = StagingRing([np.zeros(8, np.uint8) for _ in range(3)])
    in_flight: set[int] = set()
    completed: list[int] = []
    for step in range(12):
        index, buffer = ring.acquire()
        assert index not in in_flight, f"buffer {index} reused at step {step} while in flight"
        buffer[:] = step
        in_flight.add(index)
        ring.release(index, SlowFence(index, in_flight, 0.002),
                     lambda b=buffer, s=step: completed.append(int(b[0]) == s))
    ring.drain()
    assert not in_flight
    assert completed == [True] * 12  # no buffer was overwritten before its completion ran
    assert ring.num_waits == 9
