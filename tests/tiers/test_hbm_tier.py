"""The hbm tier on the CPU backend (a host-memory pool with its own capacity): placement across
hbm, host and disk, promotion on the second hit, the cascade hbm -> host -> disk in LRU order,
capacity never exceeded, hits counted per tier, recalls of hbm hits through the engine. Every
story ends with `store.check() == []`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.config import DiskConfig, HbmConfig, HostConfig, StoreConfig
from kvtier.daemon.settings import load_config
from kvtier.errors import ConfigError
from kvtier.pools.layout import PoolLayout
from kvtier.pools.pool_pages import MappedPoolPages
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier
from kvtier.transfer import CpuBackend, Direction, PoolMemory

PAGE_BYTES = 4096
DISK_SLOT_BYTES = 4160


@pytest.fixture
def make_store3(tmp_path: Path):
    """PageStores with all three tiers, in pages of 4 KiB; closed at teardown."""
    stores: list[PageStore] = []

    def factory(hbm_pages: int = 2, host_pages: int = 4, disk_pages: int = 16,
                promote_hits: int = 2, engine: bool = False, with_bytes: bool = True) -> PageStore:
        config = StoreConfig(
            hbm=HbmConfig(capacity_bytes=hbm_pages * PAGE_BYTES, chunk_bytes=PAGE_BYTES,
                          promote_hits=promote_hits),
            host=HostConfig(capacity_bytes=host_pages * PAGE_BYTES, chunk_bytes=PAGE_BYTES),
            disk=DiskConfig(path=tmp_path / f"disk{len(stores)}",
                            capacity_bytes=disk_pages * DISK_SLOT_BYTES,
                            chunk_bytes=4 * DISK_SLOT_BYTES),
            with_bytes=with_bytes)
        store = PageStore(config, transfer_backend=CpuBackend() if engine else None)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


def labels(store: PageStore, namespace, keys: list[bytes]) -> list[str | None]:
    return [t.label if t is not None else None for t in store.lookup(namespace, keys).tiers]


def recall(store: PageStore, namespace, keys: list[bytes]) -> tuple[np.ndarray, list]:
    out = np.zeros((len(keys), PAGE_BYTES), np.uint8)
    result = store.recall(namespace, keys, out)
    assert result.ok, result
    return out, result.tiers


def test_a_second_hit_promotes_to_hbm_and_each_tier_counts_its_hits(
        make_store3, namespace, make_keys, make_pages) -> None:
    store = make_store3()
    keys, pages = make_keys(3, seed=1), make_pages(3, seed=1)
    assert store.store(namespace, keys, pages).ok
    assert labels(store, namespace, keys) == ["host"] * 3  # stores go to host

    out, tiers = recall(store, namespace, keys[:1])  # first hit: stays in host
    assert tiers == [Tier.HOST] and labels(store, namespace, keys[:1]) == ["host"]
    out, tiers = recall(store, namespace, keys[:1])  # second hit: served, then promoted
    assert tiers == [Tier.HOST] and labels(store, namespace, keys) == ["hbm", "host", "host"]
    out, tiers = recall(store, namespace, keys)
    assert tiers == [Tier.HBM, Tier.HOST, Tier.HOST]
    assert np.array_equal(out, pages)

    stats = store.stats()
    assert [t.tier for t in stats.tiers] == ["hbm", "host", "disk"]
    hbm, host = stats.tier("hbm"), stats.tier("host")
    # lookups: 3 + 1 + 3 keys; the hbm tier saw one hit (the last lookup's first key).
    assert (hbm.hits, hbm.misses) == (1, 6)
    assert (host.hits, host.misses) == (6, 0)
    assert (hbm.num_pages, hbm.used_bytes, hbm.capacity_bytes) == (1, PAGE_BYTES, 2 * PAGE_BYTES)
    assert host.num_pages == 3  # the promoted page keeps its host copy
    assert stats.counters.promotions == 1
    assert store.check() == []


def test_hbm_victims_cascade_to_host_and_host_victims_to_disk_in_lru_order(
        make_store3, namespace, make_keys, make_pages, store_each) -> None:
    store = make_store3(hbm_pages=2, host_pages=4)
    keys, pages = make_keys(8, seed=2), make_pages(8, seed=2)
    a, b, c, d, e, f, g, h = keys
    store_each(store, namespace, [a, b, c, d], pages[:4])  # four uses, not one prefix
    for _ in range(2):
        recall(store, namespace, [a])
    for _ in range(2):
        recall(store, namespace, [b])
    recall(store, namespace, [c])  # one hit each: host LRU order is now a, b, c, d
    recall(store, namespace, [d])
    assert labels(store, namespace, [a, b, c, d]) == ["hbm", "hbm", "host", "host"]

    # Host is full: storing e, f evicts its LRU pages a and b, whose host copies go to disk
    # (write-back) while hbm keeps serving them.
    assert store.store(namespace, [e, f], pages[4:6]).ok
    assert labels(store, namespace, keys[:6]) == ["hbm", "hbm", "host", "host", "host", "host"]
    assert store.stats().tier("disk").num_pages == 2

    # c's second hit promotes it: hbm is full, its LRU page a leaves hbm. a has no host copy, so
    # it is demoted to host, which evicts host's LRU page (d; c is being read) to disk.
    recall(store, namespace, [c])
    assert labels(store, namespace, keys[:6]) == ["host", "hbm", "hbm", "disk", "host", "host"]
    for tier in store.stats().tiers:
        assert tier.used_bytes <= tier.capacity_bytes
    assert store.stats().tier("hbm").evictions == 1
    assert store.stats().tier("host").evictions == 3

    out, tiers = recall(store, namespace, keys[:6])
    assert np.array_equal(out, pages[:6])
    assert store.check() == []


def test_deleting_pages_frees_their_hbm_slots(make_store3, namespace, make_keys,
                                              make_pages) -> None:
    store = make_store3()
    keys, pages = make_keys(2, seed=3), make_pages(2, seed=3)
    assert store.store(namespace, keys, pages).ok
    for _ in range(2):
        recall(store, namespace, keys)
    assert labels(store, namespace, keys) == ["hbm", "hbm"]
    assert store.delete(namespace, keys) == 2
    assert store.stats().tier("hbm").num_pages == 0
    assert store.stats().tier("host").num_pages == 0
    assert store.check() == []


def test_recalls_of_hbm_hits_into_engine_pools_go_through_the_hbm_engine(
        make_store3, namespace, make_keys) -> None:
    store = make_store3(hbm_pages=4, host_pages=8, engine=True)
    layout = PoolLayout.layer_first(16, 2, 16, 2, 16, "bfloat16")
    data = np.random.default_rng(4).integers(0, 256, layout.span_bytes, np.uint8)
    memory = PoolMemory(layout, data)
    view = layout.page_view(data)

    def pages(ids: list[int]) -> MappedPoolPages:
        return MappedPoolPages(view, ids).bind_lanes("cpu", memory)

    keys = make_keys(4, seed=4)
    assert store.store(namespace, keys, pages([0, 1, 2, 3])).ok
    saved = [view[p].reshape(-1).copy() for p in range(4)]
    for target in ([4, 5, 6, 7], [8, 9, 10, 11]):
        assert store.recall(namespace, keys, pages(target)).ok
    result = store.recall(namespace, keys, pages([15, 14, 13, 12]))
    assert result.ok and result.tiers == [Tier.HBM] * 4
    for index, page in enumerate([15, 14, 13, 12]):
        assert np.array_equal(view[page].reshape(-1), saved[index])
    hbm_lane = store.hbm_lanes_by_key["cpu"].lane_stats()[Direction.H2D]
    assert hbm_lane.bytes_moved == 4 * PAGE_BYTES
    assert store.check() == []


@pytest.mark.parametrize("seed", range(4))
def test_random_work_keeps_three_tiers_within_capacity_and_bytes_exact(
        make_store3, namespace, make_keys, make_pages, seed: int) -> None:
    rng = np.random.default_rng(seed)
    store = make_store3(hbm_pages=3, host_pages=5, disk_pages=12)
    keys, pages = make_keys(24, seed=100 + seed), make_pages(24, seed=100 + seed)
    present: set[int] = set()
    for step in range(120):
        chosen = sorted({int(i) for i in rng.integers(0, 24, int(rng.integers(1, 4)))})
        action = rng.random()
        if action < 0.35:
            result = store.store(namespace, [keys[i] for i in chosen], pages[chosen])
            assert not result.failed, result
            present.update(chosen)
        elif action < 0.9:
            out = np.zeros((len(chosen), PAGE_BYTES), np.uint8)
            result = store.recall(namespace, [keys[i] for i in chosen], out)
            for row, i in enumerate(chosen):
                if keys[i] in result.recalled:
                    assert np.array_equal(out[row], pages[i]), f"step {step}: page {i} differs"
            assert not result.failed
        else:
            store.delete(namespace, [keys[i] for i in chosen])
            present.difference_update(chosen)
        for tier in store.stats().tiers:
            assert tier.used_bytes <= tier.capacity_bytes, f"step {step}: {tier}"
        assert store.check() == [], f"step {step}"
    stats = store.stats()
    assert stats.tier("hbm").bytes_read > 0 and stats.counters.promotions > 0  # served from hbm


def test_metadata_only_replay_keeps_three_tier_accounting(make_store3, namespace,
                                                          make_keys) -> None:
    store = make_store3(with_bytes=False)
    keys = make_keys(3, seed=5)
    assert store.store(namespace, keys, None).ok
    for _ in range(2):
        assert store.recall(namespace, keys[:2], None).ok
    assert labels(store, namespace, keys) == ["hbm", "hbm", "host"]
    assert store.check() == []


def test_hbm_is_off_by_default_and_configured_in_bytes() -> None:
    assert not load_config(env={}).store.hbm.enabled
    config = load_config(env={"KVTIER_HBM_CAPACITY": "8GiB", "KVTIER_HBM_PROMOTE_HITS": "3"})
    assert config.store.hbm.capacity_bytes == 8 << 30 and config.store.hbm.promote_hits == 3
    assert config.store.hbm.device is None
    assert load_config(env={"KVTIER_HBM_DEVICE": "1"}).store.hbm.device == 1
    with pytest.raises(ConfigError, match="hbm.promote_hits"):
        load_config(env={"KVTIER_HBM_PROMOTE_HITS": "0"})
    with pytest.raises(ConfigError, match="hbm"):
        HbmConfig(capacity_bytes=-1)


def test_threads_recalling_hot_pages_keep_three_tiers_sound(make_store3, namespace, make_keys,
                                                            make_pages, run_threads) -> None:
    store = make_store3(hbm_pages=3, host_pages=6, disk_pages=32)
    keys, pages = make_keys(16, seed=7), make_pages(16, seed=7)
    assert not store.store(namespace, keys, pages).failed

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(60):
            chosen = sorted({int(i) for i in rng.integers(0, 16, 3)})
            out = np.zeros((len(chosen), PAGE_BYTES), np.uint8)
            result = store.recall(namespace, [keys[i] for i in chosen], out)
            # A page being demoted is invisible for the copy (as with two tiers): it may be
            # missed now and then, never served wrong.
            assert not result.failed, result
            for row, i in enumerate(chosen):
                if keys[i] in result.recalled:
                    assert np.array_equal(out[row], pages[i])

    run_threads(worker, range(4))
    for tier in store.stats().tiers:
        assert tier.used_bytes <= tier.capacity_bytes
    assert store.stats().counters.promotions > 0
    assert store.lookup(namespace, keys).num_prefix == 16  # nothing was lost
    assert store.check() == []
