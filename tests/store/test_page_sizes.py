"""Several page sizes in one store: a size moving in costs one chunk, a promotion loses nothing.

Each tier carves its chunks for one page size at a time. These stories pin what that must never
cost: a recall's promoted pages ending in no tier (the cascade host -> disk -> dropped reaching
the very pages being promoted), a new page size evicting a whole tier for one slot, a page
dropped from its last tier without being counted.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import DiskConfig, HostConfig, StoreConfig
from kvtier.errors import CapacityError
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier
from kvtier.tiers.page_format import HEADER_BYTES
from kvtier.tiers.slots import MIN_CHUNKS_PER_TIER
from tests.conftest import random_keys, random_pages

MiB = 1 << 20


def namespace_of(page_bytes: int, model: str) -> Namespace:
    return Namespace(model, "bfloat16", "page-first", 16, page_bytes)


def open_store(tmp_path: Path, host_bytes: int, disk_bytes: int, host_chunk_bytes: int,
               disk_chunk_bytes: int) -> PageStore:
    return PageStore(StoreConfig(
        host=HostConfig(capacity_bytes=host_bytes, chunk_bytes=host_chunk_bytes, policy="lru"),
        disk=DiskConfig(path=tmp_path / "disk", capacity_bytes=disk_bytes,
                        chunk_bytes=disk_chunk_bytes, policy="lru")))


def test_pages_recalled_after_a_tiny_page_moved_in_stay_in_a_tier(tmp_path: Path) -> None:
    """The attack as found: 64 MiB host, 256 MiB disk, the default 256 MiB chunks; eight 16 KiB
    pages, then one 4-byte page of another model, then a recall of the eight."""
    store = open_store(tmp_path, 64 * MiB, 256 * MiB, 256 * MiB, 256 * MiB)
    try:
        victim, tiny = namespace_of(16384, "victim"), namespace_of(4, "tiny")
        keys, pages = random_keys(8, seed=1), random_pages(8, seed=1, page_bytes=16384)
        assert store.store(victim, keys, pages).ok
        assert store.store(tiny, random_keys(1, seed=2), random_pages(1, 2, page_bytes=4)).ok
        for _ in range(2):  # the first recall promoted; the second must still find every page
            out = np.zeros_like(pages)
            result = store.recall(victim, keys, out)
            assert result.recalled == keys and np.array_equal(out, pages)
        assert None not in store.lookup(victim, keys).tiers
        assert store.stats().counters.pages_dropped == 0
        assert store.check(verify_bytes=True) == []
    finally:
        store.close()


def test_a_promotion_into_one_chunk_tiers_keeps_the_promoted_pages(tmp_path: Path) -> None:
    """Tiers of one chunk each (chunks asked for at 32 KiB are kept): the promotion evicts the
    tiny page from host, whose demotion finds disk holding only the pages being promoted. The
    tiny page is dropped, and counted; the promoted pages are in host and on disk."""
    page_bytes = 8192
    disk_bytes = 4 * (HEADER_BYTES + page_bytes)
    store = open_store(tmp_path, 4 * page_bytes, disk_bytes, 4 * page_bytes, disk_bytes)
    try:
        victim, tiny = namespace_of(page_bytes, "victim"), namespace_of(4, "tiny")
        keys, pages = random_keys(4, seed=3), random_pages(4, seed=3, page_bytes=page_bytes)
        tiny_key = random_keys(1, seed=4)
        assert store.store(victim, keys, pages).ok
        assert store.store(tiny, tiny_key, random_pages(1, 4, page_bytes=4)).ok
        assert store.lookup(victim, keys).tiers == [Tier.DISK] * 4  # host took the tiny page

        out = np.zeros_like(pages)
        assert store.recall(victim, keys, out).recalled == keys and np.array_equal(out, pages)

        assert store.lookup(victim, keys).tiers == [Tier.HOST] * 4
        again = np.zeros_like(pages)
        assert store.recall(victim, keys, again).recalled == keys
        assert np.array_equal(again, pages)
        assert store.lookup(tiny, tiny_key).tiers == [None]
        counters = store.stats().counters
        assert counters.pages_dropped == 1 and counters.demotion_failures == 1
        assert store.check(verify_bytes=True) == []
    finally:
        store.close()


def test_a_new_page_size_evicts_one_chunk_not_the_tier(tmp_path: Path) -> None:
    """Host: 4 chunks of 4 pages, used so the LRU order runs across the chunks (the first page
    of each, then the second of each...). A page of another size takes one chunk: the 4 pages of
    the chunk holding the least recently used page leave, the other 12 stay."""
    page_bytes = 4096
    store = PageStore(StoreConfig(
        host=HostConfig(capacity_bytes=16 * page_bytes, chunk_bytes=4 * page_bytes,
                        policy="lru"),
        disk=DiskConfig(path=tmp_path / "disk", capacity_bytes=1, enabled=False)))
    try:
        model, other = namespace_of(page_bytes, "model"), namespace_of(2048, "other")
        keys, pages = random_keys(16, seed=5), random_pages(16, seed=5, page_bytes=page_bytes)
        for key, page in zip(keys, pages):  # one by one: unrelated pages (plain LRU)
            assert store.store(model, [key], page[None]).ok  # chunk c: keys[4c : 4c + 4]
        across_chunks = [keys[4 * chunk + slot] for slot in range(4) for chunk in range(4)]
        for key in across_chunks:
            assert store.recall(model, [key], np.zeros((1, page_bytes), np.uint8)).ok

        assert store.store(other, random_keys(1, seed=6), random_pages(1, 6, 2048)).ok

        tiers = store.lookup(model, keys).tiers
        assert tiers == [None] * 4 + [Tier.HOST] * 12
        assert store.stats().tier("host").evictions == 4
        assert store.stats().counters.pages_dropped == 4  # no disk: they left their last tier
        assert store.check(verify_bytes=True) == []
    finally:
        store.close()


def test_a_tier_too_small_for_its_chunk_gets_smaller_chunks_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`--disk-capacity 1MiB` with the default 256 MiB chunk: 64 KiB chunks, a line at start,
    and a page too big for them refused naming the setting."""
    caplog.set_level(logging.INFO, logger="kvtier")
    store = open_store(tmp_path, 64 * MiB, 1 * MiB, 256 * MiB, 256 * MiB)
    try:
        assert store.disk is not None
        assert store.disk.slots.chunk_bytes == 64 << 10
        assert store.disk.slots.num_chunks == MIN_CHUNKS_PER_TIER
        assert store.host.slots.chunk_bytes == 4 * MiB
        assert any("disk tier: chunks of 64.0 KiB instead of 256.0 MiB" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        model = namespace_of(32768, "fits")
        assert store.store(model, random_keys(20, 7), random_pages(20, 7, 32768)).ok
        with pytest.raises(CapacityError, match="disk.chunk"):
            store.store(namespace_of(128 << 10, "too-big"), random_keys(1, 8),
                        random_pages(1, 8, 128 << 10))
        assert store.check(verify_bytes=True) == []
    finally:
        store.close()
