"""Stores and recalls on random layouts, mappings and data: mapped pages land exactly, nothing
else moves, the source stays as it was; the segment lists of the CUDA kernels, applied with numpy,
do the same."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import ProtocolError
from kvtier.transfer import CpuBackend, Direction, DuplexLanes, LaneJob, PoolPageIds
from kvtier.transfer.segments import cap_lengths, plan_segments, split_chunks


def arena_page(arena: np.ndarray, slot: int, page_bytes: int) -> np.ndarray:
    return arena[slot : slot + page_bytes]


def pool_page(data: np.ndarray, layout, page: int) -> np.ndarray:
    return layout.page_view(data)[page].reshape(-1)  # a copy when the page is strided


def set_pool_page(data: np.ndarray, layout, page: int, page_bytes: np.ndarray) -> None:
    layout.page_view(data)[page] = page_bytes.reshape(layout.page_view(data).shape[1:])


@pytest.mark.parametrize("seed", range(6))
def test_store_then_recall_moves_exactly_the_mapped_pages(harness, kit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    layout = kit.random_layout(rng)
    data = kit.random_bytes(rng, layout.span_bytes + int(rng.integers(0, 64)))
    pool = harness.pool(layout, data.copy())
    slot_bytes = -(-layout.page_bytes // 64) * 64
    num_slots = layout.num_pages + 4
    arena = kit.random_bytes(rng, num_slots * slot_bytes)
    arena_before = arena.copy()
    engine = harness.engine(arena)
    count = int(rng.integers(1, layout.num_pages + 1))
    pages = rng.choice(layout.num_pages, count, replace=False)
    slots = kit.slot_offsets(rng, count, layout.page_bytes, num_slots, slot_bytes)

    engine.submit_store(PoolPageIds(pool, pages), slots, kit.keys_for(count)).result(60)

    assert np.array_equal(harness.read(pool), data), "a store changed its source"
    expected = arena_before.copy()
    for page, slot in zip(pages, slots):
        expected[slot : slot + layout.page_bytes] = pool_page(data, layout, page)
    assert np.array_equal(arena, expected)

    # Recall the stored slots into a shuffled set of pages of a fresh pool.
    fresh = kit.random_bytes(rng, data.nbytes)
    target = harness.pool(layout, fresh.copy())
    into = rng.permutation(layout.num_pages)[:count]
    arena_stored = arena.copy()
    engine.submit_recall(PoolPageIds(target, into), slots, kit.keys_for(count)).result(60)

    assert np.array_equal(arena, arena_stored), "a recall changed the arena"
    expected_pool = fresh.copy()
    for page, slot in zip(into, slots):
        set_pool_page(expected_pool, layout, page, arena[slot : slot + layout.page_bytes])
    assert np.array_equal(harness.read(target), expected_pool)


def test_many_jobs_of_one_tick_batch_and_all_land(harness, kit) -> None:
    rng = np.random.default_rng(7)
    from kvtier.pools.layout import PoolLayout

    layout = PoolLayout.page_first(32, 2, 4, 1, 16, "bfloat16")
    data = kit.random_bytes(rng, layout.span_bytes)
    pool = harness.pool(layout, data)
    arena = np.zeros(32 * layout.page_bytes, np.uint8)
    engine = harness.engine(arena)
    jobs = [engine.submit_store(PoolPageIds(pool, [i]), [i * layout.page_bytes], kit.keys_for(1, i))
            for i in range(32)]
    for job in jobs:
        job.result(60)
    assert np.array_equal(arena, data[: arena.nbytes])


def test_bad_submissions_are_rejected_with_a_sentence(kit) -> None:
    from kvtier.pools.layout import PoolLayout
    from kvtier.transfer import PoolMemory

    layout = PoolLayout.page_first(4, 1, 1, 1, 8, "uint8")
    pool = PoolMemory(layout, np.zeros(layout.span_bytes, np.uint8))
    with DuplexLanes(CpuBackend(), np.zeros(64, np.uint8)) as engine:
        with pytest.raises(ProtocolError, match="out of range"):
            engine.submit_store(PoolPageIds(pool, [4]), [0], kit.keys_for(1))
        with pytest.raises(ProtocolError, match="does not fit"):
            engine.submit_store(PoolPageIds(pool, [0]), [60], kit.keys_for(1))
        with pytest.raises(ProtocolError, match="one of each"):
            engine.submit_recall(PoolPageIds(pool, [0, 1]), [0], kit.keys_for(2))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("direction", list(Direction))
def test_kernel_segment_lists_applied_with_numpy_match_the_pool_copy(
        kit, seed: int, direction: Direction) -> None:
    """What gather/scatter would do with the CUDA backend's lists, done here byte by byte."""
    from kvtier.transfer import PoolMemory

    rng = np.random.default_rng(100 + seed)
    layout = kit.random_layout(rng)
    data = kit.random_bytes(rng, layout.span_bytes)
    pool = PoolMemory(layout, data)
    slot_bytes = -(-layout.page_bytes // 64) * 64
    num_slots = layout.num_pages + 2
    arena = kit.random_bytes(rng, num_slots * slot_bytes)
    jobs = []
    for tag in range(3):
        count = int(rng.integers(1, layout.num_pages + 1))
        jobs.append(LaneJob(direction, PoolPageIds(pool, rng.choice(layout.num_pages, count,
                                                                  replace=False)),
                        kit.slot_offsets(rng, count, layout.page_bytes, num_slots, slot_bytes),
                        kit.keys_for(count, tag)))
    staging_bytes = max(layout.segment_bytes, int(rng.integers(1, 4)) * layout.segment_bytes)
    plan = cap_lengths(plan_segments(jobs, {id(pool): 0}), staging_bytes)
    assert int(plan.lengths.sum()) == sum(j.num_pages for j in jobs) * layout.page_bytes
    pool_copy, arena_copy = data.copy(), arena.copy()
    for start, stop in split_chunks(plan.lengths, staging_bytes):
        assert int(plan.lengths[start:stop].sum()) <= staging_bytes
        for addr, offset, length in zip(plan.pool_addrs[start:stop].tolist(),
                                        plan.arena_offsets[start:stop].tolist(),
                                        plan.lengths[start:stop].tolist()):
            if direction is Direction.D2H:
                arena_copy[offset : offset + length] = pool_copy[addr : addr + length]
            else:
                pool_copy[addr : addr + length] = arena_copy[offset : offset + length]
    expected_pool, expected_arena = data.copy(), arena.copy()
    for job in jobs:
        for page, slot in zip(job.page_ids, job.slot_offsets):
            if direction is Direction.D2H:
                expected_arena[slot : slot + layout.page_bytes] = pool_page(expected_pool, layout,
                                                                            page)
            else:
                set_pool_page(expected_pool, layout, page,
                              expected_arena[slot : slot + layout.page_bytes])
    assert np.array_equal(pool_copy, expected_pool)
    assert np.array_equal(arena_copy, expected_arena)
