"""The remote tier on a three-master Redis Cluster: pages spread over shards, and a shard restart
mid-run loses pages (misses) but never serves wrong bytes."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from kvtier.keys import prefix_keys
from kvtier.store.pages import Tier

PAGE_BYTES = 4096
NUM_PAGES = 96


def test_pages_spread_over_shards_and_survive_a_shard_restart(redis_cluster, make_node,
                                                              remote_namespace):
    from kvtier.testing import redis as harness
    writer = make_node("writer", redis_cluster.url, host_pages=NUM_PAGES)
    assert writer.remote.wait_connected(60)
    tokens = np.random.default_rng(7).integers(0, 32000, NUM_PAGES * 16).tolist()
    keys = prefix_keys(remote_namespace, tokens)
    data = np.random.default_rng(8).integers(0, 256, (NUM_PAGES, PAGE_BYTES), np.uint8)
    assert writer.store(remote_namespace, keys, data).ok
    assert writer.remote.drain()
    counts = harness.shard_key_counts(redis_cluster)
    assert sum(counts) == NUM_PAGES and min(counts) > 0, f"pages per shard: {counts}"

    reader = make_node("reader", redis_cluster.url, host_pages=NUM_PAGES)
    out = np.zeros_like(data)
    result = reader.recall(remote_namespace, keys, out)
    assert result.ok and set(result.tiers) == {Tier.REMOTE}
    assert np.array_equal(out, data)

    redis_cluster.restart(1)  # killed and started empty: its third of the pages is gone
    lost = counts[1]
    late = make_node("late", redis_cluster.url, host_pages=NUM_PAGES)
    for _ in range(3):  # a round trip may meet the restarted shard's stale connection
        out = np.zeros_like(data)
        result = late.recall(remote_namespace, keys, out)
        if len(result.missing) == lost:
            break
        assert late.remote.wait_connected(60)
    served = [i for i, tier in enumerate(result.tiers) if tier is not None]
    assert len(served) == NUM_PAGES - lost
    assert np.array_equal(out[served], data[served]), "wrong bytes served after a shard restart"
    missing = [i for i, tier in enumerate(result.tiers) if tier is None]
    assert not out[missing].any(), "a missed page's buffer must be left untouched"

    # Writes after the restart reach the restarted shard again.
    assert writer.remote.wait_connected(60)
    more = prefix_keys(remote_namespace, tokens[: 16 * 8], parent_key=b"\x02" * 16)
    more_data = np.random.default_rng(9).integers(0, 256, (8, PAGE_BYTES), np.uint8)
    assert writer.store(remote_namespace, more, more_data).ok
    assert writer.remote.drain()
    check = np.zeros_like(more_data)
    assert late.recall(remote_namespace, more, check).ok
    assert np.array_equal(check, more_data)
    assert late.check() == [] and writer.check() == []


def test_traffic_during_a_shard_restart_never_serves_wrong_bytes(redis_cluster, make_node,
                                                                 remote_namespace):
    """Two nodes store and recall without pause while a shard is killed and restarted."""
    # Short round trips on purpose: a timeout here is a miss, which this test tolerates. The
    # final check runs while node r may still be promoting pages it has deleted since: their
    # slots are counted (tests/store/test_store_concurrency.py covers that race on its own).
    writer = make_node("w", redis_cluster.url, host_pages=8, timeout_s=0.5)
    reader = make_node("r", redis_cluster.url, host_pages=8, timeout_s=0.5)
    rng = np.random.default_rng(21)
    stored: dict[bytes, np.ndarray] = {}
    problems: list[str] = []
    stop = threading.Event()
    served = 0  # pages node r served; `progress` announces each batch
    progress = threading.Condition()

    def traffic() -> None:
        try:
            run_traffic()
        except Exception as exc:  # reported by the main thread, which stops waiting at once
            problems.append(f"traffic failed: {type(exc).__name__}: {exc}")
            with progress:
                progress.notify_all()

    def run_traffic() -> None:
        nonlocal served
        local = np.random.default_rng(22)
        while not stop.is_set():
            keys = [local.bytes(16) for _ in range(4)]
            data = local.integers(0, 256, (4, PAGE_BYTES), np.uint8)
            if writer.store(remote_namespace, keys, data).ok:
                stored.update(zip(keys, data))
            writer.remote.drain(5)
            sample = list(stored)[-16:]
            out = np.zeros((len(sample), PAGE_BYTES), np.uint8)
            result = reader.recall(remote_namespace, sample, out)
            for i, key in enumerate(sample):
                if result.tiers[i] is not None and not np.array_equal(out[i], stored[key]):
                    problems.append(f"wrong bytes for {key.hex()}")
            with progress:
                served += sum(tier is not None for tier in result.tiers)
                progress.notify_all()
            reader.delete(remote_namespace, sample)  # the next recall goes to the remote again

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        from kvtier.testing import redis as harness
        with progress:
            assert progress.wait_for(lambda: served >= 32 or problems, 60), "no traffic"
        redis_cluster.restart(int(rng.integers(0, 3)))
        before = served
        assert writer.remote.wait_connected(60) and reader.remote.wait_connected(60)
        with progress:
            assert progress.wait_for(lambda: served >= before + 32 or problems, 60), \
                "no traffic after the restart"
        assert sum(harness.shard_key_counts(redis_cluster)) > 0
    finally:
        stop.set()
        worker.join(60)
    assert not problems, problems[:5]
    assert writer.check() == [] and reader.check() == []


def test_a_tls_cluster_is_reached_through_rediss_seeds(tmp_path, make_node, remote_namespace):
    from kvtier.testing import redis as harness
    if harness.REDIS_SERVER is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    cluster = harness.RedisCluster(tmp_path / "tls-cluster", tls=True)
    try:
        cluster.start()
        assert cluster.url.startswith("rediss://")
        writer = make_node("tls-w", cluster.url)
        reader = make_node("tls-r", cluster.url)
        # Waited for: on a busy machine the cluster's TLS start may outlast the brief wait.
        assert writer.remote.wait_connected(60), writer.remote.stats()
        assert reader.remote.wait_connected(60), reader.remote.stats()
        keys = prefix_keys(remote_namespace, list(range(16 * 24)))
        data = np.random.default_rng(31).integers(0, 256, (24, PAGE_BYTES), np.uint8)
        assert writer.store(remote_namespace, keys, data).ok and writer.remote.drain()
        assert min(harness.shard_key_counts(cluster)) > 0
        out = np.zeros_like(data)
        assert reader.recall(remote_namespace, keys, out).ok
        assert np.array_equal(out, data)
    finally:
        cluster.stop()
