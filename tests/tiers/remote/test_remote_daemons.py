"""Two real daemons ("nodes": own sockets, arenas and disk dirs) sharing one real Redis, and a
daemon whose Redis is absent at start, dies mid-run and comes back."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from kvtier.testing import daemon as harness
from kvtier.testing import redis as redis_harness

NUM_PAGES = 16


@pytest.fixture(autouse=True)
def generous_remote_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemons these tests start inherit it: no round trip times out on a busy machine."""
    monkeypatch.setenv("KVTIER_REMOTE_TIMEOUT", str(redis_harness.ROUND_TRIP_TIMEOUT_S))


def remote_stats(client) -> dict:
    return client.stats()["remote"]


def start_node(make_daemon, socket_dir, tmp_path, name: str, url: str, *args: str):
    return make_daemon(socket_dir / f"{name}.sock", tmp_path / name / "disk", "--remote-url", url,
                       *args)


def test_a_prefix_stored_on_one_node_is_recalled_on_another(redis_server, make_daemon, make_pool,
                                                            socket_dir, tmp_path):
    node_a = start_node(make_daemon, socket_dir, tmp_path, "a", redis_server.url)
    node_b = start_node(make_daemon, socket_dir, tmp_path, "b", redis_server.url)
    node_a.assert_logged("remote redis://127.0.0.1")
    layout = harness.make_layout("page-first", NUM_PAGES)
    namespace = harness.namespace_for(layout, "shared-model")
    rng = np.random.default_rng(11)
    keys = harness.random_keys(rng, NUM_PAGES)
    pool_a, pool_b = make_pool(layout), make_pool(layout)
    harness.fill_random(pool_a, rng, range(NUM_PAGES))
    expected = harness.snapshot(pool_a, range(NUM_PAGES))
    with node_a.client("a") as client_a, node_b.client("b") as client_b:
        handle_a = pool_a.register(client_a, namespace)
        assert client_a.store(handle_a, keys, range(NUM_PAGES)).result().ok
        harness.wait_until(lambda: remote_stats(client_a)["pages_written"] == NUM_PAGES
                           and remote_stats(client_a)["pending_bytes"] == 0, "node a's writes")
        handle_b = pool_b.register(client_b, namespace)
        lookup = client_b.lookup(handle_b, keys)
        assert lookup.num_prefix == NUM_PAGES
        result = client_b.recall(handle_b, keys, range(NUM_PAGES)).result()
        assert result.ok
        assert np.array_equal(harness.snapshot(pool_b, range(NUM_PAGES)), expected)
        # A recall of keys node b never looked up is served from the remote directly.
        more = harness.random_keys(rng, 4)
        assert client_a.store(handle_a, more, range(4)).result().ok
        harness.wait_until(lambda: remote_stats(client_a)["pages_written"] == NUM_PAGES + 4
                           and remote_stats(client_a)["pending_bytes"] == 0, "node a's writes")
        direct = client_b.recall(handle_b, more, range(4)).result()
        assert direct.ok and direct.tiers == ["remote"] * 4
        assert np.array_equal(harness.snapshot(pool_b, range(4)), expected[:4])
        stats_b = client_b.stats()
        assert stats_b["remote"]["hits"] == NUM_PAGES + 4 and stats_b["remote"]["connected"]
        assert "lookup_remote" in stats_b["latency"]
        assert client_b.check() == [] and client_a.check() == []
    shown = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "stats", "--socket",
                            str(node_b.socket_path)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "remote tier redis://127.0.0.1" in shown.stdout and "connected" in shown.stdout


def test_a_daemon_serves_local_tiers_through_a_remote_outage(make_daemon, make_pool, socket_dir,
                                                             tmp_path):
    if redis_harness.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = redis_harness.RedisServer(tmp_path / "redis")  # down at start
    node = start_node(make_daemon, socket_dir, tmp_path, "n", server.url)
    node.assert_logged("unreachable at start")
    layout = harness.make_layout("layer-first", NUM_PAGES)
    namespace = harness.namespace_for(layout, "outage-model", "layer-first")
    rng = np.random.default_rng(12)
    keys = harness.random_keys(rng, NUM_PAGES)
    pool = make_pool(layout)
    harness.fill_random(pool, rng, range(NUM_PAGES))
    expected = harness.snapshot(pool, range(NUM_PAGES))
    try:
        with node.client() as client:
            handle = pool.register(client, namespace)
            assert client.store(handle, keys[:8], range(8)).result().ok
            assert client.lookup(handle, keys).num_prefix == 8
            assert remote_stats(client)["connected"] is False
            server.start()
            harness.wait_until(lambda: remote_stats(client)["connected"], "the reconnect")
            node.assert_logged("reconnected")
            assert client.store(handle, keys[8:], range(8, NUM_PAGES), keys[7]).result().ok
            harness.wait_until(lambda: remote_stats(client)["pages_written"] == 8,
                               "the writes after reconnecting")
            server.stop()  # dies mid-run
            client.lookup(handle, keys + [b"\x07" * 16])  # the round trip that finds it gone
            harness.wait_until(lambda: not remote_stats(client)["connected"], "the outage flag")
            node.assert_logged("serving local tiers only")
            started = time.perf_counter()
            for _ in range(50):
                assert client.lookup(handle, keys + [b"\x07" * 16]).num_prefix == NUM_PAGES
            per_lookup_s = (time.perf_counter() - started) / 50
            bound_s = redis_harness.OFFLINE_ANSWER_BOUND_S / 10  # far below the timeout
            assert per_lookup_s < bound_s, f"lookups slowed to {per_lookup_s * 1e3:.1f} ms offline"
            pool.pages[:] = 0
            assert client.recall(handle, keys, range(NUM_PAGES)).result().ok
            assert np.array_equal(harness.snapshot(pool, range(NUM_PAGES)), expected)
            server.start()
            harness.wait_until(lambda: remote_stats(client)["connected"], "the second reconnect")
            assert remote_stats(client)["outages"] == 2
            assert client.check() == []
    finally:
        server.stop()


def test_pages_swapped_out_by_rotate_reach_the_remote(redis_server, make_daemon, make_pool,
                                                      socket_dir, tmp_path):
    """rotate sends its swap-outs from the host slots it owns, not from pool pages that its
    swap-ins overwrite in the same call."""
    node_a = start_node(make_daemon, socket_dir, tmp_path, "a", redis_server.url)
    node_b = start_node(make_daemon, socket_dir, tmp_path, "b", redis_server.url)
    layout = harness.make_layout("page-first", 8)
    namespace = harness.namespace_for(layout, "rotate-model")
    rng = np.random.default_rng(13)
    resident, paused = harness.random_keys(rng, 4), harness.random_keys(rng, 4)
    pool_a, pool_b = make_pool(layout), make_pool(layout)
    with node_a.client("a") as client_a, node_b.client("b") as client_b:
        handle_a = pool_a.register(client_a, namespace)
        harness.fill_random(pool_a, rng, range(8))
        assert client_a.store(handle_a, resident, range(4)).result().ok
        paused_bytes = harness.snapshot(pool_a, range(4, 8))
        # Swap pages 4..7 out and the resident pages into the same pool pages, in one call.
        rotated = client_a.rotate(handle_a, paused, range(4, 8), resident, range(4, 8)).result()
        assert rotated.ok, rotated
        harness.wait_until(lambda: remote_stats(client_a)["pending_bytes"] == 0
                           and remote_stats(client_a)["pages_written"] == 8, "node a's writes")
        handle_b = pool_b.register(client_b, namespace)
        result = client_b.recall(handle_b, paused, range(4)).result()
        assert result.ok and result.tiers == ["remote"] * 4
        assert np.array_equal(harness.snapshot(pool_b, range(4)), paused_bytes)
