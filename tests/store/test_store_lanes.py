"""PageStore copies through a transfer engine's lanes: engine pools bound with `bind_lanes` are
stored on the d2h lane and recalled on the h2d lane, both lanes at once; an injected copy failure
fails exactly its keys, which never become visible; numpy callers keep their own copy path.
Every story ends with `store.check() == []`."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvtier.config import WritePolicy
from kvtier.pools.layout import PoolLayout
from kvtier.pools.pool_file import CopyWay, PoolFile
from kvtier.pools.pool_pages import MappedPoolPages, PoolFilePages
from kvtier.shm import SHM_DIR
from kvtier.store.pages import Tier
from kvtier.transfer import CpuBackend, Direction, PoolMemory
from kvtier.transfer.cpu import CpuMover

# 4 KiB pages (the `namespace` fixture's), fragmented the vLLM way: one segment per layer, K, V.
LAYOUT = PoolLayout.layer_first(32, 2, 16, 2, 16, "bfloat16")


class Pool:
    """An engine pool in plain memory, as the daemon binds a shared-memory one."""

    def __init__(self, seed: int) -> None:
        self.data = np.random.default_rng(seed).integers(0, 256, LAYOUT.span_bytes, np.uint8)
        self.memory = PoolMemory(LAYOUT, self.data)

    def pages(self, page_ids: list[int]) -> MappedPoolPages:
        return MappedPoolPages(LAYOUT.page_view(self.data), page_ids).bind_lanes("cpu", self.memory)

    def page(self, page_id: int) -> np.ndarray:
        return LAYOUT.page_view(self.data)[page_id].reshape(-1).copy()


@pytest.fixture
def lane_store(make_store):
    def factory(**options):
        store = make_store(**options)
        store.open_lanes("cpu", CpuBackend())
        return store
    return factory


def test_pool_pages_go_through_the_lanes_numpy_buffers_do_not(lane_store, namespace,
                                                               make_keys, make_pages) -> None:
    assert LAYOUT.page_bytes == namespace.page_bytes
    store = lane_store(host_pages=16)
    engine = store.lanes_by_key["cpu"]
    pool, keys = Pool(1), make_keys(8, seed=1)
    assert store.store(namespace, keys, pool.pages(list(range(8)))).ok
    assert engine.lane_stats()[Direction.D2H].bytes_moved == 8 * LAYOUT.page_bytes

    target = Pool(2)
    untouched = [target.page(p) for p in range(32)]
    into = [31, 9, 20, 8, 10, 11, 12, 3]
    result = store.recall(namespace, keys, target.pages(into))
    assert result.ok and result.tiers == [Tier.HOST] * 8
    assert engine.lane_stats()[Direction.H2D].bytes_moved == 8 * LAYOUT.page_bytes
    for index, page in enumerate(into):
        assert np.array_equal(target.page(page), pool.page(index))
    for page in set(range(32)) - set(into):
        assert np.array_equal(target.page(page), untouched[page])

    numpy_keys, rows = make_keys(2, seed=3), make_pages(2, seed=3)
    assert store.store(namespace, numpy_keys, rows).ok  # in-process callers: their own thread
    out = np.zeros_like(rows)
    assert store.recall(namespace, numpy_keys, out).ok and np.array_equal(out, rows)
    assert engine.lane_stats()[Direction.D2H].bytes_moved == 8 * LAYOUT.page_bytes
    assert store.check() == []


def fail_page(monkeypatch, direction: Direction, bad_page: int) -> None:
    """Make every copy touching pool page `bad_page` in `direction` raise."""
    real_copy = CpuMover._copy

    def failing(self, pool, first_page, first_slot, stride, count):
        if self.direction is direction and first_page <= bad_page < first_page + count:
            raise OSError(f"injected: pool page {bad_page} is unreachable")
        real_copy(self, pool, first_page, first_slot, stride, count)

    monkeypatch.setattr(CpuMover, "_copy", failing)


def test_a_failed_store_copy_names_its_key_and_the_page_never_shows(
        lane_store, namespace, make_keys, monkeypatch) -> None:
    store = lane_store(host_pages=16)
    pool, keys = Pool(4), make_keys(6, seed=4)
    fail_page(monkeypatch, Direction.D2H, 3)
    result = store.store(namespace, keys, pool.pages([0, 1, 2, 3, 4, 5]))
    assert list(result.failed) == [keys[3]] and "injected" in result.failed[keys[3]]
    assert result.stored == keys[:3] + keys[4:]
    tiers = store.lookup(namespace, keys).tiers
    assert tiers == [Tier.HOST] * 3 + [None] + [Tier.HOST] * 2
    assert store.stats().tier("host").num_pages == 5  # the failed page's slot was freed
    assert store.check() == []

    monkeypatch.undo()  # the page stores fine once the pool is reachable again
    assert store.store(namespace, [keys[3]], pool.pages([3])).stored == [keys[3]]
    assert store.check() == []


def test_a_failed_recall_copy_names_its_key_and_leaves_the_page_stored(
        lane_store, namespace, make_keys, monkeypatch) -> None:
    store = lane_store(host_pages=16)
    pool, keys = Pool(5), make_keys(4, seed=5)
    assert store.store(namespace, keys, pool.pages([0, 1, 2, 3])).ok
    target = Pool(6)
    before = target.page(12)
    fail_page(monkeypatch, Direction.H2D, 12)
    result = store.recall(namespace, keys, target.pages([10, 11, 12, 13]))
    assert list(result.failed) == [keys[2]] and result.recalled == keys[:2] + keys[3:]
    assert result.tiers == [Tier.HOST, Tier.HOST, None, Tier.HOST]
    assert np.array_equal(target.page(12), before)
    assert store.stats().counters.integrity_errors == 0  # a copy failure is no corrupt page
    assert store.lookup(namespace, keys).tiers == [Tier.HOST] * 4
    assert store.delete(namespace, keys) == 4  # no reader count was left behind
    assert store.stats().tier("host").num_pages == 0
    assert store.check() == []


def test_stores_and_recalls_from_many_threads_share_both_lanes(
        lane_store, namespace, make_keys, run_threads) -> None:
    store = lane_store(host_pages=64, disk_enabled=False)
    pool, keys = Pool(7), make_keys(32, seed=7)
    assert store.store(namespace, keys[:16], pool.pages(list(range(16)))).ok
    targets = [Pool(10 + i) for i in range(4)]

    def worker(number: int) -> None:
        for round_ in range(5):
            if number % 2:
                own = keys[16 + 4 * (number // 2) + 8 * (round_ % 2):][:4]
                result = store.store(namespace, own, pool.pages([keys.index(k) for k in own]))
                assert not result.failed
            else:
                result = store.recall(namespace, keys[:16], targets[number].pages(
                    list(range(16, 32))))
                assert result.ok
                for index in range(16):
                    assert np.array_equal(targets[number].page(16 + index), pool.page(index))

    run_threads(worker, range(4), timeout_s=30)
    stats = store.lanes_by_key["cpu"].lane_stats()
    assert stats[Direction.D2H].num_ticks > 0 and stats[Direction.H2D].num_ticks > 0
    assert store.lookup(namespace, keys).num_prefix == 32
    assert store.check() == []


def test_rotate_swaps_in_after_the_same_page_swapped_out_even_when_stores_are_slow(
        lane_store, namespace, make_keys, monkeypatch) -> None:
    store = lane_store(host_pages=16)
    pool, resumed_keys = Pool(20), make_keys(4, seed=20)
    assert store.store(namespace, resumed_keys, pool.pages([0, 1, 2, 3])).ok
    resumed = [pool.page(p) for p in range(4)]
    pool.data[:] = Pool(21).data  # the pool moved on
    paused = [pool.page(p) for p in (4, 5, 6)]
    real_copy = CpuMover._copy

    def slow_stores(self, *args):  # without the per-page wait the swap-ins would land first
        if self.direction is Direction.D2H:
            time.sleep(0.02)
        real_copy(self, *args)

    monkeypatch.setattr(CpuMover, "_copy", slow_stores)
    paused_keys = make_keys(3, seed=22)
    result = store.rotate(namespace, paused_keys, pool.pages([4, 5, 6]), resumed_keys,
                          pool.pages([6, 5, 4, 9]))
    assert result.ok and result.recalled.tiers == [Tier.HOST] * 4
    for index, page in enumerate([6, 5, 4, 9]):
        assert np.array_equal(pool.page(page), resumed[index])
    out = np.zeros((3, namespace.page_bytes), np.uint8)
    assert store.recall(namespace, paused_keys, out).ok
    assert all(np.array_equal(out[i], paused[i]) for i in range(3))
    assert store.check() == []


def test_rotate_keeps_a_page_whose_swap_out_failed_and_names_both_keys(
        lane_store, namespace, make_keys, monkeypatch) -> None:
    store = lane_store(host_pages=16)
    pool, resumed_keys = Pool(30), make_keys(3, seed=30)
    assert store.store(namespace, resumed_keys, pool.pages([0, 1, 2])).ok
    resumed = [pool.page(p) for p in range(3)]
    pool.data[:] = Pool(31).data
    kept = pool.page(5)
    fail_page(monkeypatch, Direction.D2H, 5)
    paused_keys = make_keys(2, seed=32)
    result = store.rotate(namespace, paused_keys, pool.pages([4, 5]), resumed_keys,
                          pool.pages([4, 5, 7]))
    assert list(result.stored.failed) == [paused_keys[1]]
    assert "injected" in result.stored.failed[paused_keys[1]]
    assert list(result.recalled.failed) == [resumed_keys[1]]  # it would have overwritten page 5
    assert result.recalled.tiers == [Tier.HOST, None, Tier.HOST]
    assert np.array_equal(pool.page(5), kept)
    assert np.array_equal(pool.page(4), resumed[0]) and np.array_equal(pool.page(7), resumed[2])
    assert store.lookup(namespace, paused_keys).tiers == [Tier.HOST, None]
    assert store.check() == []


def test_rotate_without_an_engine_is_a_store_then_a_recall(make_store, namespace, make_keys,
                                                          make_pages) -> None:
    store = make_store(host_pages=8)
    keys, pages = make_keys(4, seed=40), make_pages(4, seed=40)
    assert store.store(namespace, keys[:2], pages[:2]).ok
    out = np.zeros((2, namespace.page_bytes), np.uint8)
    result = store.rotate(namespace, keys[2:], pages[2:], keys[:2], out)
    assert result.ok and result.stored.stored == keys[2:]
    assert np.array_equal(out, pages[:2])
    assert store.check() == []


@pytest.fixture
def pool_file(tmp_path):
    """An engine pool as the daemon's CPU path holds one: a client's /dev/shm segment, opened as
    a `PoolFile` (every copy into or out of it is a `PoolFile.copy_pages` call)."""
    name = f"kvtier-test-pool-{os.getpid()}-{tmp_path.name}"
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, LAYOUT.span_bytes)
    finally:
        os.close(fd)
    opened = PoolFile.open(name, os.getuid())
    yield opened
    opened.close()
    path.unlink()


def pool_file_pages(pool_file: PoolFile, page_ids: list[int]) -> np.ndarray:
    """The pool's pages `page_ids`, read back, one row each."""
    out = np.empty((len(page_ids), LAYOUT.page_bytes), np.uint8)
    PoolFilePages(pool_file, LAYOUT, page_ids).write_into(
        out.reshape(-1), [(i * LAYOUT.page_bytes, i) for i in range(len(page_ids))],
        LAYOUT.page_bytes)
    return out


def test_a_disk_hit_into_an_engine_pool_crosses_into_the_pool_once(
        lane_store, namespace, make_keys, make_pages, pool_file, monkeypatch, tmp_path) -> None:
    keys, rows = make_keys(8, seed=20), make_pages(8, seed=20)
    disk_path = tmp_path / "crossings"
    first = lane_store(host_pages=16, disk_pages=16, disk_path=disk_path)
    assert first.store(namespace, keys, rows).ok
    first.close()  # write-back: host pages go to disk at exit; the reopened store finds them there
    store = lane_store(host_pages=16, disk_pages=16, disk_path=disk_path)
    assert store.lookup(namespace, keys).tiers == [Tier.DISK] * 8

    pages_moved = {CopyWay.INTO_POOL: 0, CopyWay.OUT_OF_POOL: 0}
    real_copy_pages = PoolFile.copy_pages

    def counting(self, way, layout, first_page, count, *args):
        pages_moved[way] += count
        real_copy_pages(self, way, layout, first_page, count, *args)

    monkeypatch.setattr(PoolFile, "copy_pages", counting)
    into = [30, 2, 17, 5, 6, 7, 21, 0]
    memory = PoolMemory(LAYOUT, pool_file)
    result = store.recall(namespace, keys, PoolFilePages(pool_file, LAYOUT, into).bind_lanes(
        "cpu", memory))
    assert result.ok and result.tiers == [Tier.DISK] * 8
    # Verified bytes go into the pool once, and the host copy is made from the landed rows:
    # nothing is read back out of the pool (on a GPU, that would be a second PCIe crossing).
    assert pages_moved == {CopyWay.INTO_POOL: 8, CopyWay.OUT_OF_POOL: 0}
    # They went in from their new host slots on the h2d lane, batched as host hits are.
    lane_stats = store.lanes_by_key["cpu"].lane_stats()
    assert lane_stats[Direction.H2D].bytes_moved == 8 * LAYOUT.page_bytes
    assert lane_stats[Direction.D2H].bytes_moved == 0
    monkeypatch.undo()

    assert np.array_equal(pool_file_pages(pool_file, into), rows)  # the pool holds the pages
    assert store.lookup(namespace, keys).tiers == [Tier.HOST] * 8  # promoted, from the landing rows
    again = np.zeros_like(rows)
    assert store.recall(namespace, keys, again).ok and np.array_equal(again, rows)
    assert store.check() == []


def test_disk_hits_not_copied_up_land_from_their_rows(
        lane_store, namespace, make_keys, make_pages, pool_file, tmp_path) -> None:
    """A host tier of 3 pages takes 3 of 8 disk hits: those reach the pool on the h2d lane from
    their host slots, the other 5 from the rows they were verified in; all 8 arrive."""
    keys, rows = make_keys(8, seed=21), make_pages(8, seed=21)
    disk_path = tmp_path / "partly"
    first = lane_store(host_pages=16, disk_pages=16, disk_path=disk_path)
    assert first.store(namespace, keys, rows).ok
    first.close()
    store = lane_store(host_pages=3, disk_pages=16, disk_path=disk_path)
    into = [9, 1, 4, 3, 12, 7, 25, 14]
    memory = PoolMemory(LAYOUT, pool_file)
    result = store.recall(namespace, keys, PoolFilePages(pool_file, LAYOUT, into).bind_lanes(
        "cpu", memory))
    assert result.ok and result.tiers == [Tier.DISK] * 8
    promoted = store.lookup(namespace, keys).tiers.count(Tier.HOST)
    assert promoted == 3
    lane_stats = store.lanes_by_key["cpu"].lane_stats()
    assert lane_stats[Direction.H2D].bytes_moved == promoted * LAYOUT.page_bytes
    assert np.array_equal(pool_file_pages(pool_file, into), rows)
    assert store.check() == []


def test_a_disk_hit_the_h2d_lane_fails_to_deliver_lands_from_its_row(
        lane_store, namespace, make_keys, make_pages, pool_file, monkeypatch, tmp_path) -> None:
    keys, rows = make_keys(4, seed=22), make_pages(4, seed=22)
    disk_path = tmp_path / "fallback"
    first = lane_store(host_pages=16, disk_pages=16, disk_path=disk_path)
    assert first.store(namespace, keys, rows).ok
    first.close()
    store = lane_store(host_pages=16, disk_pages=16, disk_path=disk_path)
    into = [8, 2, 11, 5]
    fail_page(monkeypatch, Direction.H2D, 11)
    result = store.recall(namespace, keys, PoolFilePages(pool_file, LAYOUT, into).bind_lanes(
        "cpu", PoolMemory(LAYOUT, pool_file)))
    assert result.ok and result.tiers == [Tier.DISK] * 4
    monkeypatch.undo()
    assert np.array_equal(pool_file_pages(pool_file, into), rows)
    assert store.lookup(namespace, keys).tiers == [Tier.HOST] * 4  # copied up all the same
    assert store.check() == []


@pytest.mark.parametrize("by_lane", [True, False])
def test_a_write_through_store_from_an_engine_pool_reads_each_pool_page_once(
        lane_store, namespace, make_keys, make_pages, pool_file, monkeypatch, tmp_path,
        by_lane: bool) -> None:
    """The d2h lane (or, unbound, the caller's thread, run by run of the disk writes) copies
    each page into its host slot; the disk write is made from that slot, not from a second
    read of the pool (on a GPU, a second PCIe crossing per page)."""
    keys, rows = make_keys(8, seed=40), make_pages(8, seed=40)
    page_ids = [3, 4, 5, 6, 20, 9, 30, 1]
    PoolFilePages(pool_file, LAYOUT, page_ids).read_from(
        rows.reshape(-1), [(i * LAYOUT.page_bytes, i) for i in range(8)], LAYOUT.page_bytes)
    disk_path = tmp_path / "through"
    store = lane_store(host_pages=16, disk_pages=16, disk_path=disk_path,
                       write_policy=WritePolicy.WRITE_THROUGH)
    pages_moved = {CopyWay.INTO_POOL: 0, CopyWay.OUT_OF_POOL: 0}
    real_copy_pages = PoolFile.copy_pages

    def counting(self, way, layout, first_page, count, *args):
        pages_moved[way] += count
        real_copy_pages(self, way, layout, first_page, count, *args)

    monkeypatch.setattr(PoolFile, "copy_pages", counting)
    memory = PoolMemory(LAYOUT, pool_file)
    pages = PoolFilePages(pool_file, LAYOUT, page_ids)
    result = store.store(namespace, keys, pages.bind_lanes("cpu", memory) if by_lane else pages)
    assert result.ok
    assert pages_moved == {CopyWay.INTO_POOL: 0, CopyWay.OUT_OF_POOL: 8}  # it was 16 out
    moved_by_lane = store.lanes_by_key["cpu"].lane_stats()[Direction.D2H].bytes_moved
    assert moved_by_lane == (8 * LAYOUT.page_bytes if by_lane else 0)
    monkeypatch.undo()
    assert store.lookup(namespace, keys).tiers == [Tier.HOST] * 8
    assert store.check() == []
    store.close()
    # The disk copies, written from the host slots, hold the pool's bytes.
    reopened = lane_store(host_pages=16, disk_pages=16, disk_path=disk_path)
    assert reopened.lookup(namespace, keys).tiers == [Tier.DISK] * 8
    out = np.zeros_like(rows)
    assert reopened.recall(namespace, keys, out).ok and np.array_equal(out, rows)
    assert reopened.check() == []
