"""PageStore stories: store, lookup, recall, the eviction cascade, write policies, pins, leases.

Host tiers here hold a handful of 4 KiB pages and use LRU, so each story can assert exactly which
page sits in which tier. Every story ends with `store.check() == []`.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.config import WritePolicy
from kvtier.errors import CapacityError, ProtocolError
from kvtier.keys import Namespace
from kvtier.pools.page_access import copy_runs
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier
from kvtier.tiers.host import HostTier
from kvtier.tiers.page_format import HEADER_BYTES

PAGE_BYTES = 4096
DISK_SLOT_BYTES = HEADER_BYTES + PAGE_BYTES  # disk slots are packed at 64 bytes


def tier_labels(store: PageStore, namespace: Namespace, keys: list[bytes]) -> list[str | None]:
    return [t.label if t is not None else None for t in store.lookup(namespace, keys).tiers]


def recall_all(store: PageStore, namespace: Namespace, keys: list[bytes]) -> np.ndarray:
    out = np.zeros((len(keys), namespace.page_bytes), np.uint8)
    result = store.recall(namespace, keys, out)
    assert result.ok, result
    return out


def test_store_then_recall_is_byte_identical_and_misses_leave_rows_untouched(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=4)
    keys, pages = make_keys(5, seed=1), make_pages(5, seed=1)
    stored = [0, 2, 3]
    result = store.store(namespace, [keys[i] for i in stored], pages[stored])
    assert result.ok and result.stored == [keys[i] for i in stored]
    assert result.already_present == [] and result.failed == {}

    sentinel = make_pages(5, seed=99)
    out = sentinel.copy()
    recalled = store.recall(namespace, keys, out)
    assert recalled.recalled == [keys[0], keys[2], keys[3]]
    assert recalled.missing == [keys[1], keys[4]]
    assert recalled.failed == {} and not recalled.ok
    assert recalled.tiers == [Tier.HOST, None, Tier.HOST, Tier.HOST, None]
    assert np.array_equal(out[stored], pages[stored])
    assert np.array_equal(out[[1, 4]], sentinel[[1, 4]])
    assert store.check() == []


def test_buffers_may_be_bytes_memoryviews_or_typed_arrays(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store()
    keys, pages = make_keys(3, seed=2), make_pages(3, seed=2)
    sources = [pages[0].tobytes(), memoryview(bytearray(pages[1].tobytes())),
               pages[2].view(np.float32).reshape(4, 256)]
    assert store.store(namespace, keys, sources).ok
    targets = [bytearray(PAGE_BYTES), memoryview(bytearray(PAGE_BYTES)),
               np.zeros((2, 512), np.float32)]
    assert store.recall(namespace, keys, targets).ok
    assert bytes(targets[0]) == pages[0].tobytes()
    assert bytes(targets[1]) == pages[1].tobytes()
    assert targets[2].tobytes() == pages[2].tobytes()
    # A 3-D array is one page per leading row.
    out = np.zeros((3, 2, PAGE_BYTES // 2), np.uint8)
    assert store.recall(namespace, keys, out).ok
    assert np.array_equal(out.reshape(3, -1), pages)
    assert store.check() == []


def test_strided_2d_out_rows_are_written(make_store, namespace, make_pages, make_keys) -> None:
    store = make_store()
    keys, pages = make_keys(2, seed=3), make_pages(2, seed=3)
    assert store.store(namespace, keys, pages).ok
    backing = np.zeros((2, 2 * PAGE_BYTES), np.uint8)
    out = backing[:, ::2]  # rows are strided views
    assert store.recall(namespace, keys, out).ok
    assert np.array_equal(out, pages)
    assert not backing[:, 1::2].any()
    assert store.check() == []


def test_an_out_buffer_that_is_not_one_run_is_refused_and_left_unwritten(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store()
    keys, pages = make_keys(1, seed=4), make_pages(1, seed=4)
    assert store.store(namespace, keys, pages).ok
    backing = np.zeros((2, PAGE_BYTES), np.uint8)
    page_view = backing[:, : PAGE_BYTES // 2]  # one 4 KiB page as two separate 2 KiB runs
    with pytest.raises(ProtocolError, match="cannot be flattened without a copy"):
        store.recall(namespace, keys, [page_view])
    assert not backing.any()
    assert np.array_equal(recall_all(store, namespace, keys)[0], pages[0])
    assert store.check() == []


def test_lookup_reports_the_leading_run_as_the_prefix(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=8)
    keys, pages = make_keys(6, seed=5), make_pages(6, seed=5)
    present = [0, 1, 3, 5]
    assert store.store(namespace, [keys[i] for i in present], pages[present]).ok
    result = store.lookup(namespace, keys)
    assert result.num_prefix == 2
    assert tier_labels(store, namespace, keys) == ["host", "host", None, "host", None, "host"]
    assert store.lookup(namespace, [keys[i] for i in present]).num_prefix == 4
    assert store.lookup(namespace, [keys[2]] + keys).num_prefix == 0
    assert store.lookup(namespace, []).num_prefix == 0
    other = Namespace("other-model", "bfloat16", "page-first", 16, PAGE_BYTES)
    assert store.lookup(other, keys).tiers == [None] * 6
    assert store.check() == []


def test_restore_reports_already_present_and_keeps_the_first_bytes(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store()
    keys, pages = make_keys(4, seed=6), make_pages(4, seed=6)
    assert store.store(namespace, keys[:3], pages[:3]).stored == keys[:3]
    again = store.store(namespace, keys, make_pages(4, seed=7))
    assert again.stored == [keys[3]]
    assert again.already_present == keys[:3]
    assert again.failed == {}
    out = recall_all(store, namespace, keys)
    assert np.array_equal(out[:3], pages[:3])
    assert np.array_equal(out[3], make_pages(4, seed=7)[3])
    assert store.stats().counters.pages_stored == 4
    assert store.check() == []


def test_store_larger_than_host_keeps_its_first_pages_in_host(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=3, disk_pages=16)
    keys, pages = make_keys(8, seed=8), make_pages(8, seed=8)
    result = store.store(namespace, keys, pages)
    assert result.ok and sorted(result.stored) == sorted(keys)
    assert tier_labels(store, namespace, keys) == ["host"] * 3 + ["disk"] * 5
    stats = store.stats()
    assert stats.tier("host").num_pages == 3 and stats.tier("disk").num_pages == 5
    # The rest went straight to disk: no page was copied to host and then demoted.
    assert stats.counters.demotions == 0 and stats.tier("host").evictions == 0
    assert stats.tier("disk").bytes_written == 5 * PAGE_BYTES
    for index, key in enumerate(keys):
        assert np.array_equal(recall_all(store, namespace, [key])[0], pages[index])
    assert store.check() == []


def test_a_run_larger_than_both_tiers_keeps_its_prefix_and_names_the_rest(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=2, disk_pages=2, disk_chunk_bytes=DISK_SLOT_BYTES)
    keys, pages = make_keys(6, seed=27), make_pages(6, seed=27)
    result = store.store(namespace, keys, pages)
    assert result.stored == keys[:4]
    assert sorted(result.failed) == sorted(keys[4:])
    assert all("disk tier is full" in problem for problem in result.failed.values())
    assert tier_labels(store, namespace, keys) == ["host"] * 2 + ["disk"] * 2 + [None] * 2
    assert store.lookup(namespace, keys).num_prefix == 4
    assert np.array_equal(recall_all(store, namespace, keys[:4]), pages[:4])
    assert store.check() == []


def test_lru_order_decides_which_host_page_goes_to_disk(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=3, write_policy=WritePolicy.WRITE_BACK)
    a, b, c, d, e = make_keys(5, seed=9)
    pages = make_pages(5, seed=9)
    for key, page in zip((a, b, c), pages[:3], strict=True):
        assert store.store(namespace, [key], page[None]).ok
    recall_all(store, namespace, [a])  # a becomes the most recent
    store.lookup(namespace, [b])  # a lookup is not a use: b stays least recent
    assert store.store(namespace, [d], pages[3][None]).ok
    assert tier_labels(store, namespace, [a, b, c, d]) == ["host", "disk", "host", "host"]
    assert store.store(namespace, [e], pages[4][None]).ok
    assert tier_labels(store, namespace, [a, b, c, d, e]) == [
        "host", "disk", "disk", "host", "host"]
    assert store.stats().counters.demotions == 2
    assert store.check() == []


def test_a_page_leaving_host_for_its_kept_disk_copy_counts_as_recent_on_disk(
        make_store, namespace, make_pages, make_keys, store_each) -> None:
    """b is last used before a: when the disk must drop one of them, b goes, though b reached
    the disk after a's disk copy (which a kept when it was promoted) was last touched."""
    store = make_store(host_pages=1, disk_pages=2, disk_chunk_bytes=DISK_SLOT_BYTES)
    a, b, c, d = make_keys(4, seed=29)
    pages = make_pages(4, seed=29)
    store_each(store, namespace, [a, b], pages[:2])  # a demoted to disk
    recall_all(store, namespace, [a])  # promoted to host (keeping its disk copy); b demoted
    assert tier_labels(store, namespace, [a, b]) == ["host", "disk"]
    store_each(store, namespace, [c, d], pages[2:])  # a leaves host, then c is demoted
    assert tier_labels(store, namespace, [a, b, c, d]) == ["disk", None, "disk", "host"]
    assert np.array_equal(recall_all(store, namespace, [a])[0], pages[0])
    assert store.check() == []


def test_cascade_host_to_disk_to_dropped_in_lru_order(
        make_store, namespace, make_pages, make_keys, store_each) -> None:
    store = make_store(host_pages=2, disk_pages=2, disk_chunk_bytes=DISK_SLOT_BYTES)
    keys, pages = make_keys(6, seed=10), make_pages(6, seed=10)
    store_each(store, namespace, keys, pages)
    lookup = store.lookup(namespace, keys)
    assert [t.label if t else None for t in lookup.tiers] == [
        None, None, "disk", "disk", "host", "host"]
    assert lookup.num_prefix == 0
    stats = store.stats()
    assert stats.tier("host").evictions == 4 and stats.tier("disk").evictions == 2
    assert stats.counters.demotions == 4
    out = recall_all(store, namespace, keys[2:4])
    assert np.array_equal(out, pages[2:4])
    assert store.check() == []


def test_disk_hit_is_promoted_and_keeps_its_disk_copy(
        make_store, namespace, make_pages, make_keys, store_each) -> None:
    store = make_store(host_pages=2)
    k0, k1, k2 = make_keys(3, seed=11)
    pages = make_pages(3, seed=11)
    store_each(store, namespace, [k0, k1, k2], pages)
    assert tier_labels(store, namespace, [k0, k1, k2]) == ["disk", "host", "host"]
    disk_written = store.stats().tier("disk").bytes_written

    out = np.zeros((1, PAGE_BYTES), np.uint8)
    result = store.recall(namespace, [k0], out)
    assert result.tiers == [Tier.DISK] and np.array_equal(out[0], pages[0])
    # Promotion made room by demoting k1, the least recent host page.
    assert tier_labels(store, namespace, [k0, k1, k2]) == ["host", "disk", "host"]
    stats = store.stats()
    assert stats.counters.promotions == 1
    assert stats.tier("disk").num_pages == 2  # k0 kept its disk copy, k1 joined it
    assert stats.tier("disk").bytes_written == disk_written + PAGE_BYTES  # only k1 written

    assert store.recall(namespace, [k0], out).tiers == [Tier.HOST]
    # Evicting k0 from host again needs no disk write: its disk copy is still there.
    store.store(namespace, make_keys(3, seed=12)[:2], make_pages(2, seed=12))
    assert tier_labels(store, namespace, [k0])[0] == "disk"
    assert store.stats().tier("disk").bytes_written == disk_written + 2 * PAGE_BYTES  # k2 only
    assert np.array_equal(recall_all(store, namespace, [k0])[0], pages[0])
    assert store.check() == []


def test_disk_hits_promote_from_a_callers_block_as_one_copy_per_run(
        make_store, namespace, make_pages, make_keys, monkeypatch, tmp_path) -> None:
    # A cold recall into one contiguous array promotes the verified pages into host the way a
    # store copies them in: adjacent pages bound for adjacent slots as one copy, not one copy
    # per page (bench_tiers' disk cold recall times this promotion with the read).
    keys, pages = make_keys(8, seed=13), make_pages(8, seed=13)
    first = make_store(host_pages=8, disk_pages=16, disk_path=tmp_path / "runs")
    assert first.store(namespace, keys, pages).ok
    first.close()  # write-back: the pages reach disk at close; the reopened store finds them
    store = make_store(host_pages=8, disk_pages=16, disk_path=tmp_path / "runs")
    assert store.lookup(namespace, keys).tiers == [Tier.DISK] * 8

    copies: list[int] = []
    real_copy_in = HostTier.copy_in

    def counting(self, pairs, rows):
        copies.append(len(copy_runs(pairs, self.slot_bytes_for(rows.page_bytes), rows)))
        real_copy_in(self, pairs, rows)

    monkeypatch.setattr(HostTier, "copy_in", counting)
    out = np.zeros_like(pages)
    assert store.recall(namespace, keys, out).tiers == [Tier.DISK] * 8
    monkeypatch.undo()
    assert np.array_equal(out, pages)
    assert copies == [1]  # the 8 promoted pages, fresh host slots back to back: one copy
    assert store.lookup(namespace, keys).tiers == [Tier.HOST] * 8
    assert np.array_equal(recall_all(store, namespace, keys), pages)  # from the promoted copies
    assert store.check() == []


def test_write_through_puts_every_page_on_disk_at_store(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=4, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(3, seed=13), make_pages(3, seed=13)
    assert store.store(namespace, keys, pages).ok
    stats = store.stats()
    assert stats.tier("disk").num_pages == 3 and stats.tier("host").num_pages == 3
    assert stats.tier("disk").bytes_written == 3 * PAGE_BYTES
    assert tier_labels(store, namespace, keys) == ["host"] * 3
    assert store.check() == []
    store.close()

    reopened = make_store(host_pages=4, write_policy=WritePolicy.WRITE_THROUGH)
    assert tier_labels(reopened, namespace, keys) == ["disk"] * 3
    assert np.array_equal(recall_all(reopened, namespace, keys), pages)
    assert reopened.check() == []


@pytest.mark.parametrize("disk_enabled", [True, False])
def test_write_through_serves_the_stored_bytes_from_host(
        make_store, namespace, make_pages, make_keys, disk_enabled: bool) -> None:
    # The host copy is made run by run of the disk writes (the disk written from the host
    # slots), and in full where no disk write takes the pages.
    store = make_store(host_pages=8, write_policy=WritePolicy.WRITE_THROUGH,
                       disk_enabled=disk_enabled)
    keys, pages = make_keys(6, seed=17), make_pages(6, seed=17)
    assert store.store(namespace, keys, pages).ok
    assert tier_labels(store, namespace, keys) == ["host"] * 6
    assert np.array_equal(recall_all(store, namespace, keys), pages)
    assert store.check() == []


def test_a_write_through_store_larger_than_host_writes_every_page_whole(
        make_store, namespace, make_pages, make_keys) -> None:
    # One disk run holds the pages kept in host (written from their host slots) and those
    # that go straight to disk (written from the caller's rows).
    store = make_store(host_pages=3, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(8, seed=19), make_pages(8, seed=19)
    assert store.store(namespace, keys, pages).ok
    assert tier_labels(store, namespace, keys) == ["host"] * 3 + ["disk"] * 5
    assert np.array_equal(recall_all(store, namespace, keys[:3]), pages[:3])
    store.close()
    reopened = make_store(host_pages=3, write_policy=WritePolicy.WRITE_THROUGH)
    for index, key in enumerate(keys):
        assert np.array_equal(recall_all(reopened, namespace, [key])[0], pages[index])
    assert reopened.check() == []


def test_a_write_through_store_whose_host_copy_fails_stores_nothing(
        make_store, namespace, make_pages, make_keys, monkeypatch) -> None:
    # A page whose host slot was not filled must not reach disk from it.
    store = make_store(host_pages=8, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(3, seed=18), make_pages(3, seed=18)
    copy = store._parts.movers.copy

    def failing_copy(source, destination, entries, request):  # noqa: ANN001, ANN202
        copy(source, destination, entries, request)
        return {entries[0][0].key: "the pool went away"}

    monkeypatch.setattr(store._parts.movers, "copy", failing_copy)
    result = store.store(namespace, keys, pages)
    assert sorted(result.failed) == sorted(keys)
    assert "the pool went away" in result.failed[keys[0]]
    monkeypatch.undo()
    assert store.lookup(namespace, keys).num_prefix == 0
    assert store.stats().tier("disk").num_pages == 0
    assert store.check() == []


def test_write_through_evicts_without_writing_again(
        make_store, namespace, make_pages, make_keys, store_each) -> None:
    store = make_store(host_pages=2, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(5, seed=14), make_pages(5, seed=14)
    store_each(store, namespace, keys, pages)
    assert tier_labels(store, namespace, keys) == ["disk"] * 3 + ["host"] * 2
    stats = store.stats()
    assert stats.counters.demotions == 0
    assert stats.tier("disk").bytes_written == 5 * PAGE_BYTES
    assert np.array_equal(recall_all(store, namespace, keys), pages)
    assert store.check() == []


def test_write_back_writes_to_disk_only_on_eviction(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=3, write_policy=WritePolicy.WRITE_BACK)
    keys, pages = make_keys(4, seed=15), make_pages(4, seed=15)
    assert store.store(namespace, keys[:3], pages[:3]).ok
    assert store.stats().tier("disk").num_pages == 0
    assert store.stats().tier("disk").bytes_written == 0
    assert store.store(namespace, keys[3:], pages[3:]).ok  # evicts the first call's last page
    assert store.stats().tier("disk").num_pages == 1
    assert tier_labels(store, namespace, keys) == ["host", "host", "disk", "host"]
    assert store.check() == []
    store.close()

    # A clean close is the last eviction: every page is on disk after a restart.
    reopened = make_store(host_pages=3)
    assert tier_labels(reopened, namespace, keys) == ["disk"] * 4
    assert np.array_equal(recall_all(reopened, namespace, keys), pages)
    assert reopened.check() == []


def test_selective_demotes_only_pages_recalled_often_enough(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=2, write_policy=WritePolicy.SELECTIVE, selective_min_hits=2)
    a, b, c, d = make_keys(4, seed=16)
    pages = make_pages(4, seed=16)
    assert store.store(namespace, [a, b], pages[:2]).ok
    recall_all(store, namespace, [a])
    recall_all(store, namespace, [a])  # a: 2 hits
    recall_all(store, namespace, [b])  # b: 1 hit, and now the most recent
    assert store.store(namespace, [c], pages[2:3]).ok  # evicts a: demoted
    assert store.store(namespace, [d], pages[3:4]).ok  # evicts b: dropped
    assert tier_labels(store, namespace, [a, b, c, d]) == ["disk", None, "host", "host"]
    stats = store.stats()
    assert stats.counters.demotions == 1 and stats.tier("host").evictions == 2
    assert stats.tier("disk").num_pages == 1
    assert np.array_equal(recall_all(store, namespace, [a])[0], pages[0])
    assert store.check() == []


def test_without_a_disk_tier_evicted_pages_are_dropped(
        make_store, namespace, make_pages, make_keys, store_each) -> None:
    store = make_store(host_pages=2, disk_enabled=False)
    keys, pages = make_keys(3, seed=17), make_pages(3, seed=17)
    store_each(store, namespace, keys, pages)
    assert tier_labels(store, namespace, keys) == [None, "host", "host"]
    assert [t.tier for t in store.stats().tiers] == ["host"]
    assert np.array_equal(recall_all(store, namespace, keys[1:]), pages[1:])
    assert store.check() == []


@pytest.mark.parametrize("disk_enabled", [True, False])
def test_pages_the_host_policy_refuses_go_to_disk_or_fail_by_name(
        make_store, namespace, make_pages, make_keys, disk_enabled) -> None:
    # The prefix policy refuses a page whose parent left the tier: a1 leaves host for b1, b2;
    # then a2 and a3 (its children) are refused by host: they go straight to disk, or fail by
    # name without one; c1, stored next, is admitted.
    store = make_store(host_pages=2, host_policy="prefix", disk_enabled=disk_enabled)
    a1, b1, b2, a2, a3, c1 = make_keys(6, seed=18)
    pages = make_pages(6, seed=18)
    assert store.store(namespace, [a1], pages[:1]).ok
    assert store.store(namespace, [b1, b2], pages[1:3]).ok
    assert tier_labels(store, namespace, [a1]) == ["disk" if disk_enabled else None]
    result = store.store(namespace, [a2, a3], pages[3:5], parent_key=a1)
    both = store.store(namespace, [c1], pages[5:])
    assert both.ok
    if disk_enabled:
        assert result.ok and tier_labels(store, namespace, [a2, a3]) == ["disk", "disk"]
        assert np.array_equal(recall_all(store, namespace, [a2, a3]), pages[3:5])
    else:
        assert result.stored == [] and sorted(result.failed) == sorted([a2, a3])
        assert "did not admit" in result.failed[a2]
        assert tier_labels(store, namespace, [a2, a3]) == [None, None]
    assert store.check() == []


@pytest.mark.parametrize("disk_enabled", [True, False])
def test_pinned_pages_are_not_evicted(make_store, namespace, make_pages, make_keys, store_each,
                                      disk_enabled: bool) -> None:
    store = make_store(host_pages=3, disk_enabled=disk_enabled)
    a, b, c, d, e, f = make_keys(6, seed=18)
    pages = make_pages(6, seed=18)
    store_each(store, namespace, [a, b, c], pages[:3])
    unknown = make_keys(6, seed=19)[5]
    lease = store.pin(namespace, [a, b, unknown], ttl_s=60)
    assert lease.pinned == [a, b] and lease.missing == [unknown]
    assert store.stats().num_leases == 1
    assert store.store(namespace, [d], pages[3:4]).ok  # a is least recent but pinned: c goes
    assert tier_labels(store, namespace, [a, b, c, d]) == [
        "host", "host", "disk" if disk_enabled else None, "host"]

    lease_d = store.pin(namespace, [d], ttl_s=60)
    result = store.store(namespace, [e], pages[4:5])
    if disk_enabled:  # no host page may go: e goes straight to disk
        assert result.ok and tier_labels(store, namespace, [e]) == ["disk"]
    else:
        assert result.stored == [] and list(result.failed) == [e]
        assert "full" in result.failed[e] and "pinned" in result.failed[e]
        assert tier_labels(store, namespace, [e]) == [None]
        assert store.stats().counters.store_failures == 1
    assert store.check() == []

    store.unpin(lease.lease_id)
    assert store.store(namespace, [f], pages[5:]).ok  # a, least recent, goes now
    assert tier_labels(store, namespace, [a, b, d, f]) == [
        "disk" if disk_enabled else None, "host", "host", "host"]
    store.unpin(lease_d.lease_id)
    assert store.stats().num_leases == 0
    if disk_enabled:
        assert np.array_equal(recall_all(store, namespace, [a, b, c, d, e, f]), pages)
    assert store.check() == []


def test_pinned_disk_pages_are_not_evicted_from_disk(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=4, disk_pages=2, disk_chunk_bytes=DISK_SLOT_BYTES,
                       write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(3, seed=20), make_pages(3, seed=20)
    assert store.store(namespace, keys[:2], pages[:2]).ok
    store.pin(namespace, keys[:2], ttl_s=60)
    result = store.store(namespace, keys[2:], pages[2:])
    assert list(result.failed) == [keys[2]] and "disk tier is full" in result.failed[keys[2]]
    assert tier_labels(store, namespace, keys) == ["host", "host", None]
    assert store.stats().tier("host").num_pages == 2
    assert store.check() == []


def test_lease_expiry_unpins_with_an_injected_clock(
        make_store, namespace, make_pages, make_keys, store_each) -> None:
    now = [1000.0]
    store = make_store(host_pages=2, disk_enabled=False, clock=lambda: now[0])
    a, b, c = make_keys(3, seed=21)
    pages = make_pages(3, seed=21)
    store_each(store, namespace, [a, b], pages[:2])
    lease = store.pin(namespace, [a, b], ttl_s=10)
    now[0] += 9.5
    assert "full" in store.store(namespace, [c], pages[2:]).failed[c]
    now[0] += 0.5  # exactly at expiry
    assert store.store(namespace, [c], pages[2:]).ok
    assert tier_labels(store, namespace, [a, b, c]) == [None, "host", "host"]
    assert store.stats().num_leases == 0
    with pytest.raises(ProtocolError, match=f"no live lease {lease.lease_id}"):
        store.unpin(lease.lease_id)
    assert store.check() == []


def test_unpin_after_expiry_raises_without_another_verb(
        make_store, namespace, make_pages, make_keys) -> None:
    now = [0.0]
    store = make_store(host_pages=2, clock=lambda: now[0])
    keys = make_keys(1, seed=22)
    assert store.store(namespace, keys, make_pages(1, seed=22)).ok
    lease = store.pin(namespace, keys, ttl_s=5)
    now[0] = 6.0  # expired; no verb has run since
    try:
        with pytest.raises(ProtocolError, match="expired"):
            store.unpin(lease.lease_id)
    finally:
        assert store.check() == []


def test_unpin_unknown_or_twice_and_bad_ttl_raise(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store()
    keys = make_keys(1, seed=23)
    assert store.store(namespace, keys, make_pages(1, seed=23)).ok
    with pytest.raises(ProtocolError, match="no live lease 999"):
        store.unpin(999)
    lease = store.pin(namespace, keys, ttl_s=1)
    store.unpin(lease.lease_id)
    with pytest.raises(ProtocolError, match="expired or was released"):
        store.unpin(lease.lease_id)
    for ttl_s in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ProtocolError, match="positive ttl_s"):
            store.pin(namespace, keys, ttl_s=ttl_s)
    assert store.stats().num_leases == 0
    assert store.check() == []


def test_delete_removes_from_every_tier_and_frees_capacity(
        make_store, namespace, make_pages, make_keys, store_each) -> None:
    store = make_store(host_pages=3, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(5, seed=24), make_pages(5, seed=24)
    store_each(store, namespace, keys, pages)
    recall_all(store, namespace, keys[:1])  # promoted: now in both tiers
    assert store.delete(namespace, keys[:2]) == 2
    assert tier_labels(store, namespace, keys) == [None, None, "disk", "host", "host"]
    assert store.check() == []
    missing = make_keys(7, seed=25)[6]
    assert store.delete(namespace, keys + [missing]) == 3
    assert store.delete(namespace, keys) == 0
    stats = store.stats()
    for tier in ("host", "disk"):
        assert stats.tier(tier).used_bytes == 0 and stats.tier(tier).num_pages == 0
    assert store.lookup(namespace, keys).tiers == [None] * 5
    assert store.check() == []
    # Freed capacity is usable again, and deleted keys can be stored anew.
    assert store.store(namespace, keys, make_pages(5, seed=26)).ok
    assert np.array_equal(recall_all(store, namespace, keys), make_pages(5, seed=26))
    assert store.check() == []
    store.delete(namespace, keys[:4])
    store.close()
    reopened = make_store(host_pages=3)
    assert tier_labels(reopened, namespace, keys) == [None, None, None, None, "disk"]
    assert reopened.check() == []


def test_pages_of_two_namespaces_never_mix(make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=5)  # 3 chunks of big pages, 2 chunks of 2 small slots
    small = Namespace("test-model", "bfloat16", "page-first", 8, 2048)
    keys = make_keys(3, seed=27)
    big_pages, small_pages = make_pages(3, seed=27), make_pages(3, seed=28, page_bytes=2048)
    assert store.store(namespace, keys, big_pages).ok
    assert store.store(small, keys, small_pages).ok  # same keys, another namespace
    assert np.array_equal(recall_all(store, namespace, keys), big_pages)
    assert np.array_equal(recall_all(store, small, keys), small_pages)
    assert store.stats().num_namespaces == 2
    assert store.delete(small, keys) == 3
    assert tier_labels(store, namespace, keys) == ["host"] * 3
    assert store.check() == []


def test_page_larger_than_a_chunk_raises_capacity_error(make_store, make_keys) -> None:
    store = make_store()
    huge = Namespace("test-model", "bfloat16", "page-first", 16, 2 * PAGE_BYTES)
    with pytest.raises(CapacityError, match="does not fit"):
        store.store(huge, make_keys(1, seed=29), np.zeros((1, 2 * PAGE_BYTES), np.uint8))
    assert store.stats().num_namespaces == 0
    assert store.check() == []


@pytest.mark.parametrize("verb", ["store", "recall"])
def test_bad_buffers_raise_protocol_error(
        make_store, namespace, make_pages, make_keys, verb: str) -> None:
    store = make_store()
    keys, pages = make_keys(2, seed=30), make_pages(2, seed=30)
    if verb == "recall":
        assert store.store(namespace, keys, pages).ok
    call = getattr(store, verb)
    with pytest.raises(ProtocolError, match="2 keys but 1 page buffers"):
        call(namespace, keys, pages[:1])
    with pytest.raises(ProtocolError, match="2 keys but 3 page buffers"):
        call(namespace, keys, make_pages(3, seed=31))
    with pytest.raises(ProtocolError, match="#1 holds 4095 bytes"):
        call(namespace, keys, [np.zeros(PAGE_BYTES, np.uint8), np.zeros(4095, np.uint8)])
    with pytest.raises(ProtocolError, match="holds 8192 bytes"):
        call(namespace, keys, np.zeros((2, 2 * PAGE_BYTES), np.uint8))
    with pytest.raises(ProtocolError, match="key #1 must be 16 bytes, got 15 bytes"):
        call(namespace, [keys[0], keys[1][:15]], pages)
    stats = store.stats()
    assert stats.tier("host").num_pages == (2 if verb == "recall" else 0)
    assert stats.counters.pages_recalled == 0
    assert store.check() == []


def test_read_only_out_buffers_raise_and_stay_unwritten(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store()
    keys, pages = make_keys(2, seed=32), make_pages(2, seed=32)
    assert store.store(namespace, keys, pages).ok
    read_only = np.zeros((2, PAGE_BYTES), np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(ProtocolError, match="output buffer #0 is read-only"):
        store.recall(namespace, keys, read_only)
    with pytest.raises(ProtocolError, match="output buffer #1 is read-only"):
        store.recall(namespace, keys, [bytearray(PAGE_BYTES), bytes(PAGE_BYTES)])
    assert not read_only.any()
    assert store.check() == []


def test_bad_keys_raise_protocol_error_in_every_verb(make_store, namespace) -> None:
    store = make_store()
    bad = [bytes(16), "not-bytes"]
    page = np.zeros((2, PAGE_BYTES), np.uint8)
    for call in (lambda: store.store(namespace, bad, page),
                 lambda: store.recall(namespace, bad, page.copy()),
                 lambda: store.lookup(namespace, bad),
                 lambda: store.delete(namespace, bad),
                 lambda: store.pin(namespace, bad, ttl_s=1)):
        with pytest.raises(ProtocolError, match="key #1 must be 16 bytes, got str"):
            call()
    assert store.stats().num_leases == 0
    assert store.check() == []


def test_stats_count_hits_misses_and_bytes_per_tier(
        make_store, namespace, make_pages, make_keys, store_each) -> None:
    store = make_store(host_pages=2)
    a, b, c, x = make_keys(4, seed=33)
    store_each(store, namespace, [a, b, c], make_pages(3, seed=33))  # a demoted
    assert store.lookup(namespace, [a, b, c, x]).tiers == [Tier.DISK, Tier.HOST, Tier.HOST, None]
    stats = store.stats()
    host, disk = stats.tier("host"), stats.tier("disk")
    assert (host.hits, host.misses, disk.hits, disk.misses) == (2, 2, 1, 1)
    assert host.hit_ratio == 0.5 and disk.hit_ratio == 0.5
    assert host.capacity_bytes == 2 * PAGE_BYTES and host.used_bytes == 2 * PAGE_BYTES
    assert disk.capacity_bytes == 16 * DISK_SLOT_BYTES and disk.used_bytes == DISK_SLOT_BYTES
    assert host.bytes_written == 3 * PAGE_BYTES and disk.bytes_written == PAGE_BYTES
    assert (stats.counters.pages_stored, stats.counters.bytes_stored) == (3, 3 * PAGE_BYTES)
    assert stats.num_namespaces == 1 and stats.num_leases == 0

    out = np.zeros((2, PAGE_BYTES), np.uint8)
    result = store.recall(namespace, [b, x], out)
    assert result.recalled == [b] and result.missing == [x]
    stats = store.stats()
    assert (stats.counters.pages_recalled, stats.counters.bytes_recalled) == (1, PAGE_BYTES)
    assert stats.tier("host").bytes_read == PAGE_BYTES and stats.tier("disk").bytes_read == 0
    # Recalls do not count as lookups.
    assert (stats.tier("host").hits, stats.tier("host").misses) == (2, 2)
    store.recall(namespace, [a], out[:1])
    assert store.stats().tier("disk").bytes_read == PAGE_BYTES
    as_dict = store.stats().to_dict()
    assert [t["tier"] for t in as_dict["tiers"]] == ["host", "disk"]
    assert as_dict["tiers"][0]["hit_ratio"] == 0.5
    assert as_dict["counters"]["promotions"] == 1
    with pytest.raises(KeyError):
        store.stats().tier("hbm")
    assert store.check() == []


def test_close_is_idempotent_and_context_manager_closes(make_store, tmp_path, namespace) -> None:
    store = make_store(disk_path=tmp_path / "ctx")
    with store as same:
        assert same is store
    store.close()
    # The directory lock was released: another store may open it.
    assert make_store(disk_path=tmp_path / "ctx").check() == []
