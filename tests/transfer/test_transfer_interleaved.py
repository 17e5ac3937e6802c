"""On every backend (CPU here, CUDA under the `gpu` marker): random stores and recalls interleaved
on both lanes land exactly and touch nothing else; an injected copy failure, either way, fails its
own keys and marks nothing moved that was not; rotate on random layouts swaps each page out before
the swap-in into it."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import TransferError
from kvtier.transfer import Direction, PoolPageIds, Swap
from kvtier.transfer.cpu import CpuMover


def pool_page(data: np.ndarray, layout, page: int) -> np.ndarray:
    return layout.page_view(data)[page].reshape(-1)


def inject_failure(harness, monkeypatch, direction: Direction, bad_page: int) -> None:
    """Make the copies of `direction` that touch pool page `bad_page` raise, on either backend.

    CPU: the run holding the page fails, then each page is retried alone. CUDA: the staging
    buffer (or tick, with a pinned arena) holding the page fails as a whole.
    """
    if harness.kind == "cpu":
        real_copy = CpuMover._copy

        def failing_copy(self, pool, first_page, first_slot, stride, count):
            if self.direction is direction and first_page <= bad_page < first_page + count:
                raise OSError(f"injected: pool page {bad_page} is unreachable")
            real_copy(self, pool, first_page, first_slot, stride, count)

        monkeypatch.setattr(CpuMover, "_copy", failing_copy)
        return
    from kvtier.transfer.cuda import CudaMover

    for name in ("_move_staged", "_move_direct", "_move_dma"):
        real_step = getattr(CudaMover, name)

        def failing_step(self, *args, real_step=real_step):
            plan, start, stop = args[-3:]
            first, last = int(plan.entries[start]), int(plan.last_entries[stop - 1])
            owners = plan.owners[first : last + 1]
            if self.direction is direction and any(int(job.page_ids[index]) == bad_page
                                                   for job, index in owners):
                raise RuntimeError(f"injected: pool page {bad_page} is unreachable")
            return real_step(self, *args)

        monkeypatch.setattr(CudaMover, name, failing_step)


@pytest.mark.parametrize("seed", range(4))
def test_random_stores_and_recalls_interleaved_on_both_lanes(harness, kit, seed: int,
                                                            run_threads) -> None:
    rng = np.random.default_rng(40 + seed)
    layout = kit.random_layout(rng)
    slot_bytes = -(-layout.page_bytes // 64) * 64
    source = kit.random_bytes(rng, layout.span_bytes)
    target = kit.random_bytes(rng, layout.span_bytes)
    src_pool, dst_pool = harness.pool(layout, source.copy()), harness.pool(layout, target.copy())
    num_slots = 2 * layout.num_pages
    arena = kit.random_bytes(rng, num_slots * slot_bytes)
    arena_before = arena.copy()
    engine = harness.engine(arena)
    # Stores fill the lower half's slots, recalls read the upper half's: disjoint, so any order
    # of the two lanes gives one expected result.
    store_slots = rng.permutation(layout.num_pages) * slot_bytes
    recall_slots = (layout.num_pages + rng.permutation(layout.num_pages)) * slot_bytes
    stored_pages = rng.permutation(layout.num_pages)
    recalled_into = rng.permutation(layout.num_pages)
    chunks = np.array_split(np.arange(layout.num_pages), int(rng.integers(2, 6)))
    jobs = []

    def submit(direction: Direction) -> None:
        for number, chunk in enumerate(chunks):
            if direction is Direction.D2H:
                jobs.append(engine.submit_store(
                    PoolPageIds(src_pool, stored_pages[chunk]), store_slots[chunk],
                    kit.keys_for(len(chunk), number)))
            else:
                jobs.append(engine.submit_recall(
                    PoolPageIds(dst_pool, recalled_into[chunk]), recall_slots[chunk],
                    kit.keys_for(len(chunk), 100 + number)))

    run_threads(submit, Direction, timeout_s=30)
    for job in jobs:
        job.result(30)

    expected_arena = arena_before.copy()
    for page, slot in zip(stored_pages, store_slots):
        expected_arena[slot : slot + layout.page_bytes] = pool_page(source, layout, page)
    assert np.array_equal(arena, expected_arena), "a slot holds the wrong bytes"
    assert np.array_equal(harness.read(src_pool), source), "a store changed its source"
    expected_target = target.copy()
    view = layout.page_view(expected_target)
    for page, slot in zip(recalled_into, recall_slots):
        view[page] = arena_before[slot : slot + layout.page_bytes].reshape(view.shape[1:])
    assert np.array_equal(harness.read(dst_pool), expected_target)
    stats = engine.lane_stats()
    assert stats[Direction.D2H].bytes_moved == stats[Direction.H2D].bytes_moved == (
        layout.num_pages * layout.page_bytes)


@pytest.mark.parametrize("direction", list(Direction))
def test_an_injected_copy_failure_fails_its_own_keys_only(harness, kit, monkeypatch,
                                                          direction: Direction) -> None:
    rng = np.random.default_rng(50)
    layout = kit.random_layout(rng)
    pool_data = kit.random_bytes(rng, layout.span_bytes)
    pool = harness.pool(layout, pool_data.copy())
    page_bytes = layout.page_bytes
    arena = kit.random_bytes(rng, layout.num_pages * page_bytes)
    arena_before = arena.copy()
    engine = harness.engine(arena)
    bad_page = 2
    inject_failure(harness, monkeypatch, direction, bad_page)
    submit = engine.submit_store if direction is Direction.D2H else engine.submit_recall
    slots = np.arange(layout.num_pages) * page_bytes

    good_keys, bad_keys = kit.keys_for(2, 1), kit.keys_for(3, 2)
    assert submit(PoolPageIds(pool, [0, 1]), slots[[0, 1]], good_keys).result(30) == good_keys
    with pytest.raises(TransferError) as caught:
        submit(PoolPageIds(pool, [3, 2, 4]), slots[[3, 2, 4]], bad_keys).result(30)
    failed = caught.value.failed_keys
    assert bad_keys[1] in failed and set(failed) <= set(bad_keys)
    if harness.kind == "cpu":
        assert failed == [bad_keys[1]]  # retried page by page: exactly the unreachable page
    assert "injected" in str(caught.value)

    moved = [0, 1] + [page for page, key in zip([3, 2, 4], bad_keys) if key not in failed]
    after_pool = harness.read(pool)
    for page in range(layout.num_pages):
        slot = slots[page]
        if direction is Direction.D2H:
            expected = pool_page(pool_data, layout, page) if page in moved else (
                arena_before[slot : slot + page_bytes])
            assert np.array_equal(arena[slot : slot + page_bytes], expected), f"slot of {page}"
        else:
            expected = arena_before[slot : slot + page_bytes] if page in moved else (
                pool_page(pool_data, layout, page))
            assert np.array_equal(pool_page(after_pool, layout, page), expected), f"page {page}"


@pytest.mark.parametrize("seed", range(3))
def test_rotate_on_random_layouts_swaps_out_before_swapping_in(harness, kit, seed: int) -> None:
    rng = np.random.default_rng(60 + seed)
    layout = kit.random_layout(rng)
    page_bytes = layout.page_bytes
    data = kit.random_bytes(rng, layout.span_bytes)
    pool = harness.pool(layout, data.copy())
    num_slots = 2 * layout.num_pages
    arena = kit.random_bytes(rng, num_slots * page_bytes)
    arena_before = arena.copy()
    engine = harness.engine(arena)
    count = max(1, layout.num_pages // 2)
    out_pages = rng.choice(layout.num_pages, count, replace=False)
    out_slots = rng.choice(layout.num_pages, count, replace=False) * page_bytes
    # Swap-ins read the upper half of the arena into the pages just swapped out, reordered, and
    # one page that was not.
    others = np.setdiff1d(np.arange(layout.num_pages), out_pages)
    in_pages = rng.permutation(out_pages)
    if len(others):
        in_pages = np.concatenate([in_pages, others[:1]])
    in_slots = (layout.num_pages + rng.choice(layout.num_pages, len(in_pages), replace=False)
                ) * page_bytes

    rotation = engine.rotate(
        Swap(PoolPageIds(pool, out_pages), out_slots, kit.keys_for(count, 1)),
        Swap(PoolPageIds(pool, in_pages), in_slots, kit.keys_for(len(in_pages), 2)))
    rotation.result(30)

    for page, slot in zip(out_pages, out_slots):
        assert np.array_equal(arena[slot : slot + page_bytes], pool_page(data, layout, page))
    after = harness.read(pool)
    for page, slot in zip(in_pages, in_slots):
        assert np.array_equal(pool_page(after, layout, page),
                              arena_before[slot : slot + page_bytes])
    for page in np.setdiff1d(np.arange(layout.num_pages), in_pages):
        assert np.array_equal(pool_page(after, layout, page), pool_page(data, layout, page))
