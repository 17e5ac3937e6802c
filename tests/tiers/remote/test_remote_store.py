"""Two PageStores ("nodes": own arenas, own disk dirs) sharing one real Redis through the remote
tier: write-through and evict modes, lookup extension, recall and prefetch fallbacks, outages."""

from __future__ import annotations

import time

import numpy as np

from kvtier.keys import prefix_keys
from kvtier.store.pages import Tier
from kvtier.testing import redis as redis_harness

PAGE_BYTES = 4096


def chain(namespace, num_pages: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 32000, num_pages * 16).tolist()
    keys = prefix_keys(namespace, tokens)
    data = np.random.default_rng(seed + 1).integers(0, 256, (num_pages, PAGE_BYTES), np.uint8)
    return keys, data


def test_prefix_stored_by_one_node_is_recalled_by_another(redis_server, make_node,
                                                          remote_namespace):
    node_a = make_node("a", redis_server.url)
    node_b = make_node("b", redis_server.url)
    keys, data = chain(remote_namespace, 12, seed=1)
    assert node_a.store(remote_namespace, keys, data).ok
    assert node_a.remote.drain()
    lookup = node_b.lookup(remote_namespace, keys)
    assert lookup.num_prefix == 12  # fetched in one round trip, now in node b's host tier
    assert lookup.tiers == [Tier.HOST] * 12
    out = np.zeros_like(data)
    result = node_b.recall(remote_namespace, keys, out)
    assert result.ok and result.tiers == [Tier.HOST] * 12
    assert np.array_equal(out, data)
    stats_b = node_b.stats().remote
    assert stats_b["hits"] == 12 and stats_b["pages_written"] == 0, \
        "pages fetched from the remote must not be written back to it"
    assert node_b.check() == []


def test_lookup_keeps_only_the_leading_run_of_remote_pages(redis_server, make_node,
                                                           remote_namespace):
    node_a = make_node("a", redis_server.url)
    node_b = make_node("b", redis_server.url)
    keys, data = chain(remote_namespace, 8, seed=2)
    node_b.store(remote_namespace, keys[:2], data[:2], remote_write=False)  # local prefix
    node_a.store(remote_namespace, keys[2:5], data[2:5], parent_key=keys[1])
    node_a.store(remote_namespace, keys[6:], data[6:], parent_key=keys[5])  # after a gap
    node_a.remote.drain()
    lookup = node_b.lookup(remote_namespace, keys)
    assert lookup.num_prefix == 5
    assert lookup.tiers[:5] == [Tier.HOST] * 5 and lookup.tiers[5:] == [None] * 3
    assert node_b.lookup(remote_namespace, keys[6:], remote=False).num_prefix == 0, \
        "pages after the first remote miss are of no use and are not stored"


def test_recall_and_prefetch_of_keys_missing_locally_use_the_remote(redis_server, make_node,
                                                                    remote_namespace):
    node_a = make_node("a", redis_server.url)
    node_b = make_node("b", redis_server.url)
    keys, data = chain(remote_namespace, 6, seed=3)
    node_a.store(remote_namespace, keys, data)
    node_a.remote.drain()
    out = np.zeros((3, PAGE_BYTES), np.uint8)
    result = node_b.recall(remote_namespace, keys[:3], out)
    assert result.ok and result.tiers == [Tier.REMOTE] * 3
    assert np.array_equal(out, data[:3])
    node_b.wait_remote_promotions()  # recalled pages reach host off the recall's path
    assert node_b.lookup(remote_namespace, keys[:3], remote=False).num_prefix == 3
    prefetched = node_b.prefetch(remote_namespace, keys[3:] + [b"\x01" * 16])
    assert sorted(prefetched.recalled) == sorted(keys[3:])
    assert prefetched.missing == [b"\x01" * 16]
    assert node_b.lookup(remote_namespace, keys, remote=False).num_prefix == 6


def test_evict_mode_sends_pages_whose_last_local_copy_leaves(redis_server, make_node,
                                                             remote_namespace):
    node = make_node("a", redis_server.url, host_pages=4, disk_pages=4, write="evict")
    keys, data = chain(remote_namespace, 16, seed=4)
    for start in range(0, 16, 2):
        assert node.store(remote_namespace, keys[start:start + 2], data[start:start + 2],
                          parent_key=keys[start - 1] if start else None).ok
    node.remote.drain()
    local = node.lookup(remote_namespace, keys, remote=False).tiers
    dropped = [i for i, tier in enumerate(local) if tier is None]
    assert dropped, "16 pages in 4 host + 4 disk slots must drop some"
    assert node.stats().remote["pages_written"] == len(dropped)
    out = np.zeros((len(dropped), PAGE_BYTES), np.uint8)
    result = node.recall(remote_namespace, [keys[i] for i in dropped], out)
    assert result.ok and set(result.tiers) == {Tier.REMOTE}
    assert np.array_equal(out, data[dropped])
    assert node.check() == []


def test_evict_mode_without_disk_spills_host_victims(redis_server, make_node,
                                                     remote_namespace):
    # LRU: a chain longer than the host tier pushes its own head out (to the remote). Leaf-first
    # policies (prefix, adaptive) keep the head and refuse the rest of such a chain instead.
    node = make_node("a", redis_server.url, host_pages=4, write="evict", host_policy="lru")
    keys, data = chain(remote_namespace, 10, seed=5)
    assert node.store(remote_namespace, keys, data).ok
    node.remote.drain()
    assert node.stats().remote["pages_written"] == 6
    out = np.zeros_like(data)
    assert node.recall(remote_namespace, keys, out).ok
    assert np.array_equal(out, data)


def test_local_tiers_keep_serving_while_the_remote_is_down(redis_server, make_node,
                                                           remote_namespace):
    node = make_node("a", redis_server.url)
    keys, data = chain(remote_namespace, 8, seed=6)
    node.store(remote_namespace, keys[:4], data[:4])
    redis_server.stop()
    node.lookup(remote_namespace, keys)  # the round trip that finds the server gone
    assert not node.remote.connected
    started = time.perf_counter()
    for _ in range(20):
        lookup = node.lookup(remote_namespace, keys)
    per_lookup_s = (time.perf_counter() - started) / 20
    bound_s = redis_harness.OFFLINE_ANSWER_BOUND_S / 20
    assert per_lookup_s < bound_s, "an offline remote must not slow lookups"
    assert lookup.num_prefix == 4
    out = np.zeros((4, PAGE_BYTES), np.uint8)
    assert node.recall(remote_namespace, keys[:4], out).ok and np.array_equal(out, data[:4])
    assert node.store(remote_namespace, keys[4:], data[4:], parent_key=keys[3]).ok
    assert node.stats().remote["connected"] is False
    assert node.check() == []


def test_evict_mode_does_not_send_a_host_victim_that_keeps_an_hbm_copy(redis_server, make_node,
                                                                       remote_namespace):
    node = make_node("a", redis_server.url, host_pages=4, hbm_pages=4, write="evict")
    keys, data = chain(remote_namespace, 2, seed=7)
    node.store(remote_namespace, keys, data)
    out = np.zeros_like(data)
    for _ in range(2):  # the second hit promotes both pages into hbm, keeping host copies
        assert node.recall(remote_namespace, keys, out).ok
    assert node.lookup(remote_namespace, keys, remote=False).tiers == [Tier.HBM] * 2
    filler, filler_data = chain(remote_namespace, 8, seed=8)
    node.store(remote_namespace, filler, filler_data)  # evicts every host page
    node.remote.drain()
    assert node.lookup(remote_namespace, keys, remote=False).tiers == [Tier.HBM] * 2
    sent = {k for k in keys if node.remote.fetch([remote_namespace.fingerprint + k],
                                                 PAGE_BYTES)[0] is not None}
    assert not sent, "a page still in hbm is not leaving the node"
    assert node.check() == []
