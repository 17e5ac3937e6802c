"""A large batch copied by several threads at once: every page lands where a one-thread copy
puts it, in both directions, for one long run and for scattered pages, and for a pool whose K and
V runs lie far apart (SGLang's page_first); shares cover every page once, in order, evenly; a
part that fails is retried page by page, so exactly its unreachable page is named."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.errors import TransferError
from kvtier.pools.layout import PoolLayout
from kvtier.transfer import CpuBackend, DuplexLanes, PoolMemory, PoolPageIds, cpu
from kvtier.transfer.cpu import CpuMover, Run, cut_shares
from kvtier.transfer.segments import cut_runs_at, split_chunks

NUM_PAGES = 13  # uneven parts for 2, 3 and 4 threads
SEGMENT_BYTES = 4 * 2 * 16 * 2  # 4 tokens x 2 heads x 16 dims x bf16


def split_k_and_v_layout(num_pages: int) -> PoolLayout:
    """SGLang's page_first host pool: a page's K of every layer in one run, its V in another
    run a whole pool's K later."""
    layers = 3
    return PoolLayout(num_pages, layers, 4, 2, 16, "bfloat16",
                      page_stride_bytes=layers * SEGMENT_BYTES, layer_stride_bytes=SEGMENT_BYTES,
                      kv_stride_bytes=num_pages * layers * SEGMENT_BYTES)


LAYOUTS = {
    "split_k_and_v": split_k_and_v_layout,
    "page_first": lambda n: PoolLayout.page_first(n, 3, 4, 2, 16, "bfloat16"),
    "layer_first": lambda n: PoolLayout.layer_first(n, 3, 4, 2, 16, "bfloat16"),
}


@pytest.fixture
def small_parts(monkeypatch) -> list[int]:
    """Batches of a few pages split; the page count of every copy made is recorded."""
    monkeypatch.setattr(cpu, "SPLIT_PART_BYTES", 1)
    counts: list[int] = []
    real = CpuMover._copy

    def recording(self, pool, first_page, first_slot, stride, count):
        counts.append(count)
        real(self, pool, first_page, first_slot, stride, count)

    monkeypatch.setattr(CpuMover, "_copy", recording)
    return counts


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_run_split_across_threads_lands_every_page_where_one_copy_would(
        kit, small_parts, name: str, threads: int) -> None:
    layout = LAYOUTS[name](2 * NUM_PAGES)
    rng = np.random.default_rng(threads)
    source = kit.random_bytes(rng, layout.span_bytes)
    pool = PoolMemory(layout, source.copy())
    slot_stride = layout.page_bytes + 64  # slots a constant stride apart: one run
    arena = np.zeros(NUM_PAGES * slot_stride, np.uint8)
    slots = [page * slot_stride for page in range(NUM_PAGES)]
    with DuplexLanes(CpuBackend(threads), arena) as engine:
        engine.submit_store(PoolPageIds(pool, range(NUM_PAGES)), slots,
                            kit.keys_for(NUM_PAGES, 1)).result(60)
        # ... and back, into the pool's other half
        engine.submit_recall(PoolPageIds(pool, range(NUM_PAGES, 2 * NUM_PAGES)), slots,
                             kit.keys_for(NUM_PAGES, 2)).result(60)
    assert len(small_parts) == 2 * threads and sum(small_parts) == 2 * NUM_PAGES
    assert max(small_parts) - min(small_parts) <= 1
    view = layout.page_view(source)
    for page in range(NUM_PAGES):
        slot = arena[page * slot_stride : page * slot_stride + layout.page_bytes]
        assert np.array_equal(slot, view[page].reshape(-1)), f"slot of page {page}"
    after = layout.page_view(pool.base)
    assert np.array_equal(after[NUM_PAGES:], view[:NUM_PAGES])  # recalled where asked
    assert np.array_equal(after[:NUM_PAGES], view[:NUM_PAGES])  # the source untouched


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_scattered_pages_split_across_threads_each_land_in_their_slot(kit, small_parts,
                                                                     name: str) -> None:
    """An engine's pages are scattered: every page is its own run, and the threads share them."""
    num_pool_pages = 3 * NUM_PAGES
    layout = LAYOUTS[name](num_pool_pages)
    rng = np.random.default_rng(7)
    source = kit.random_bytes(rng, layout.span_bytes)
    pool = PoolMemory(layout, source.copy())
    pages = rng.choice(num_pool_pages, NUM_PAGES, replace=False)
    slots = rng.permutation(NUM_PAGES) * layout.page_bytes
    arena = np.zeros(NUM_PAGES * layout.page_bytes, np.uint8)
    with DuplexLanes(CpuBackend(3), arena) as engine:
        engine.submit_store(PoolPageIds(pool, pages), slots, kit.keys_for(NUM_PAGES)).result(60)
        recalled = PoolMemory(layout, np.zeros(layout.span_bytes, np.uint8))
        engine.submit_recall(PoolPageIds(recalled, pages), slots,
                             kit.keys_for(NUM_PAGES, 1)).result(60)
    assert len(small_parts) == 2 * NUM_PAGES  # one copy per page: none merged, none repeated
    view = layout.page_view(source)
    for page, slot in zip(pages, slots):
        assert np.array_equal(arena[slot : slot + layout.page_bytes], view[page].reshape(-1))
    assert np.array_equal(layout.page_view(recalled.base)[pages], view[pages])


def test_shares_cover_every_page_once_in_order_with_about_equal_bytes() -> None:
    small = PoolLayout.page_first(64, 1, 4, 1, 16, "bfloat16")  # 256-byte pages
    large = PoolLayout.page_first(64, 4, 4, 1, 16, "bfloat16")  # 1024
    runs = [Run(PoolMemory(layout, np.zeros(layout.span_bytes, np.uint8)), first, 0,
                layout.page_bytes, count, [])
            for layout, first, count in [(small, 0, 7), (large, 3, 5), (small, 20, 1),
                                         (large, 40, 9), (small, 9, 30)]]
    for num_shares in (2, 3, 5):
        shares = cut_shares(runs, num_shares)
        parts = [part for share in shares for part in share]
        pages = [(number, runs[number].first_page + start + n)
                 for number, start, count in parts for n in range(count)]
        assert pages == [(number, run.first_page + n) for number, run in enumerate(runs)
                         for n in range(run.count)]  # each page once, in run order
        sizes = [sum(count * runs[number].pool.layout.page_bytes for number, _, count in share)
                 for share in shares]
        assert max(sizes) - min(sizes) <= 2 * large.page_bytes, sizes


def test_one_thread_copies_a_run_whole(kit, small_parts) -> None:
    layout = split_k_and_v_layout(NUM_PAGES)
    pool = PoolMemory(layout, kit.random_bytes(np.random.default_rng(0), layout.span_bytes))
    arena = np.zeros(NUM_PAGES * layout.page_bytes, np.uint8)
    with DuplexLanes(CpuBackend(1), arena) as engine:
        engine.submit_store(PoolPageIds(pool, range(NUM_PAGES)),
                            [page * layout.page_bytes for page in range(NUM_PAGES)],
                            kit.keys_for(NUM_PAGES)).result(60)
    assert small_parts == [NUM_PAGES]


def test_a_failed_part_names_exactly_its_unreachable_page(kit, small_parts, monkeypatch) -> None:
    layout = split_k_and_v_layout(NUM_PAGES)
    source = kit.random_bytes(np.random.default_rng(1), layout.span_bytes)
    pool = PoolMemory(layout, source.copy())
    arena = np.zeros(NUM_PAGES * layout.page_bytes, np.uint8)
    bad_page = 6  # in the middle part of three: a helper thread's
    helpers: set[str] = set()
    real = CpuMover._copy

    def failing(self, pool_, first_page, first_slot, stride, count):
        if first_page <= bad_page < first_page + count:
            helpers.add(threading.current_thread().name)
            raise OSError(f"injected: page {bad_page} is unreadable")
        real(self, pool_, first_page, first_slot, stride, count)

    monkeypatch.setattr(CpuMover, "_copy", failing)
    keys = kit.keys_for(NUM_PAGES)
    with DuplexLanes(CpuBackend(3), arena) as engine:
        with pytest.raises(TransferError) as caught:
            engine.submit_store(PoolPageIds(pool, range(NUM_PAGES)),
                                [page * layout.page_bytes for page in range(NUM_PAGES)],
                                keys).result(60)
    assert caught.value.failed_keys == [keys[bad_page]]
    assert any(name.startswith("kvtier-copy-d2h") for name in helpers)  # failed in a helper
    view = layout.page_view(source)
    for page in range(NUM_PAGES):
        if page != bad_page:
            slot = arena[page * layout.page_bytes : (page + 1) * layout.page_bytes]
            assert np.array_equal(slot, view[page].reshape(-1)), f"slot of page {page}"


def test_copy_threads_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        CpuBackend(0)


def test_dma_runs_are_cut_where_one_host_registration_ends_and_the_next_begins() -> None:
    """The pinned arena is registered in chunks, and one cudaMemcpyAsync across two of them
    fails: on the first GPU run, the recall whose slot crossed the boundary lost 16 pages."""
    staged = np.array([0, 100, 300])
    arena = np.array([1000, 4000, 9950])
    lengths = np.array([100, 200, 300])
    bounds = np.array([1050, 4200, 10000, 10100])  # one inside, one at an end, two inside one run
    cut = cut_runs_at(staged, arena, lengths, bounds)
    pieces = list(zip(*(a.tolist() for a in cut)))
    assert pieces == [(0, 1000, 50), (50, 1050, 50), (100, 4000, 200),
                      (300, 9950, 50), (350, 10000, 100), (450, 10100, 150)]
    source = np.arange(20000) % 251  # the pieces move the same bytes as the runs
    moved, whole = np.zeros(600, np.int64), np.zeros(600, np.int64)
    for staged_at, arena_at, length in pieces:
        moved[staged_at : staged_at + length] = source[arena_at : arena_at + length]
    for staged_at, arena_at, length in zip(staged, arena, lengths):
        whole[staged_at : staged_at + length] = source[arena_at : arena_at + length]
    assert np.array_equal(moved, whole)
    untouched = cut_runs_at(staged, arena, lengths, np.array([50, 4200]))
    assert [a.tolist() for a in untouched] == [[0, 100, 300], [1000, 4000, 9950], [100, 200, 300]]


@pytest.mark.parametrize("seed", range(5))
def test_chunks_are_filled_greedily_and_cover_every_segment_once(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, int(rng.integers(1, 300))).astype(np.uint64)
    chunk_bytes = int(rng.integers(100, 1000))
    expected, start, filled = [], 0, 0
    for index, length in enumerate(lengths.tolist()):  # the plain loop it replaced
        if filled + length > chunk_bytes:
            expected.append((start, index))
            start, filled = index, 0
        filled += length
    expected.append((start, len(lengths)))
    assert split_chunks(lengths, chunk_bytes) == expected
    with pytest.raises(ValueError, match="exceeds"):
        split_chunks(np.array([5, 101], dtype=np.uint64), 100)
