"""RemoteTier against a real redis-server: round trips, verification, TTL, budget, outages."""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import threading
import time

import numpy as np
import pytest
import redis

from kvtier.config import RemoteConfig
from kvtier.errors import ConfigError
from kvtier.testing import redis as HARNESS
from kvtier.tiers.remote import RemoteTier, frame_page, redact

PAGE_BYTES = 4096


def scoped_keys(count: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(32) for _ in range(count)]


def pages(count: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, PAGE_BYTES), dtype=np.uint8)


@pytest.fixture
def make_tier():
    tiers: list[RemoteTier] = []

    def factory(url: str, **config: object) -> RemoteTier:
        config.setdefault("timeout_s", HARNESS.ROUND_TRIP_TIMEOUT_S)
        tier = RemoteTier(RemoteConfig(url=url, **config))
        tiers.append(tier)
        return tier

    yield factory
    for tier in tiers:
        tier.close()


def test_pages_round_trip_byte_identical_and_misses_are_none(redis_server, make_tier):
    tier = make_tier(redis_server.url)
    keys, data = scoped_keys(8), pages(8)
    for key, page in zip(keys, data):
        assert tier.put(key, frame_page(key, page))
    assert tier.drain()
    absent = scoped_keys(1, seed=99)
    got = tier.fetch(keys + absent, PAGE_BYTES)
    for page, payload in zip(data, got[:8]):
        assert np.array_equal(np.frombuffer(payload, np.uint8), page)
    assert got[8] is None
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["pages_written"]) == (8, 1, 8)
    assert stats["connected"] and stats["bytes_read"] == 8 * PAGE_BYTES


def test_keys_carry_the_namespace_fingerprint(redis_server, make_tier):
    tier = make_tier(redis_server.url, key_prefix="kvt")
    key = scoped_keys(1)[0]
    tier.put(key, frame_page(key, pages(1)[0]))
    tier.drain()
    assert redis_server.cli("keys", "*").split() == [f"kvt:{key[:16].hex()}:{key[16:].hex()}"]


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "other_page", "truncated"])
def test_a_corrupt_value_is_a_miss_and_is_deleted(redis_server, make_tier, damage, caplog):
    tier = make_tier(redis_server.url)
    keys, data = scoped_keys(2), pages(2)
    value = bytearray(frame_page(keys[0], data[0]))
    if damage == "flip_payload":
        value[100] ^= 0xFF
    elif damage == "flip_header":
        value[40] ^= 0x01  # inside the key field
    elif damage == "other_page":
        value = bytearray(frame_page(keys[1], data[1]))  # right format, wrong key
    else:
        value = value[:-1]
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(tier.name_of(keys[0]), bytes(value))
    assert tier.fetch([keys[0]], PAGE_BYTES) == [None]
    assert tier.stats()["integrity_errors"] == 1
    assert "integrity error: remote page" in caplog.text
    tier.drain()
    assert raw.exists(tier.name_of(keys[0])) == 0, "a corrupt remote page must be deleted"
    raw.close()


def test_ttl_is_set_on_every_page(redis_server, make_tier):
    tier = make_tier(redis_server.url, ttl_s=300)
    key = scoped_keys(1)[0]
    tier.put(key, frame_page(key, pages(1)[0]))
    tier.drain()
    assert 0 < int(redis_server.cli("ttl", tier.name_of(key))) <= 300


def test_byte_budget_deletes_this_nodes_oldest_pages(redis_server, make_tier):
    value_bytes = len(frame_page(scoped_keys(1)[0], pages(1)[0]))
    tier = make_tier(redis_server.url, budget_bytes=3 * value_bytes)
    keys, data = scoped_keys(5), pages(5)
    for key, page in zip(keys, data):
        tier.put(key, frame_page(key, page))
        tier.drain()  # one batch per page, so "oldest" is well defined
    assert int(redis_server.cli("dbsize")) == 3
    got = tier.fetch(keys, PAGE_BYTES)
    assert [g is not None for g in got] == [False, False, True, True, True]
    stats = tier.stats()
    assert stats["written_bytes"] <= 3 * value_bytes
    assert stats["pages_expired_by_budget"] == 2


def test_server_down_at_start_then_up(tmp_path, make_tier, caplog):
    from kvtier.testing import redis as harness
    if harness.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = harness.RedisServer(tmp_path / "late")  # not started yet
    tier = make_tier(server.url)
    assert not tier.connected
    assert "unreachable at start" in caplog.text
    key = scoped_keys(1)[0]
    started = time.perf_counter()
    assert tier.fetch([key], PAGE_BYTES) == [None]
    assert time.perf_counter() - started < harness.OFFLINE_ANSWER_BOUND_S, \
        "an offline tier must answer at once, not after a round-trip timeout"
    assert not tier.put(key, frame_page(key, pages(1)[0]))
    assert tier.stats()["writes_dropped"] == 1
    server.start()
    try:
        assert tier.wait_connected(60), "the remote tier never reconnected"
        assert "reconnected" in caplog.text
        assert tier.put(key, frame_page(key, pages(1)[0]))
        tier.drain()
        assert tier.fetch([key], PAGE_BYTES)[0] is not None
    finally:
        server.stop()


def test_server_dies_mid_run_and_comes_back(redis_server, make_tier, caplog):
    tier = make_tier(redis_server.url)
    keys, data = scoped_keys(4), pages(4)
    for key, page in zip(keys, data):
        tier.put(key, frame_page(key, page))
    tier.drain()
    redis_server.stop()
    assert tier.fetch(keys, PAGE_BYTES) == [None] * 4  # the failing round trip: all misses
    assert not tier.connected and tier.stats()["outages"] == 1
    assert "serving local tiers only" in caplog.text
    started = time.perf_counter()
    assert tier.fetch(keys, PAGE_BYTES) == [None] * 4
    assert time.perf_counter() - started < HARNESS.OFFLINE_ANSWER_BOUND_S
    redis_server.start()  # same port, empty (no persistence)
    assert tier.wait_connected(60), "the remote tier never reconnected"
    assert tier.fetch(keys, PAGE_BYTES) == [None] * 4  # the data is gone, never wrong
    tier.put(keys[0], frame_page(keys[0], data[0]))
    tier.drain()
    assert np.array_equal(np.frombuffer(tier.fetch(keys[:1], PAGE_BYTES)[0], np.uint8), data[0])


def test_url_password_is_redacted_and_bad_config_is_refused():
    assert redact("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact("rediss://user:s3cret@host:6379") == "rediss://user:***@host:6379"
    assert redact("redis://host:6379") == "redis://host:6379"
    with pytest.raises(ConfigError, match="must start with redis://"):
        RemoteConfig(url="http://host:6379")
    with pytest.raises(ConfigError, match="write mode"):
        RemoteConfig(url="redis://h", write="sometimes")


def test_rediss_urls_speak_tls(tmp_path, make_tier):
    from kvtier.testing import redis as harness
    if harness.REDIS_SERVER is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    server = harness.RedisServer(tmp_path / "tls", tls=True)
    server.start()
    try:
        tier = make_tier(server.url)
        # Waited for: on a busy machine the TLS handshake may outlast the start's brief wait.
        assert tier.wait_connected(60), tier.stats()
        assert tier.url.startswith("rediss://")
        keys, data = scoped_keys(2), pages(2)
        for key, page in zip(keys, data):
            tier.put(key, frame_page(key, page))
        assert tier.drain()
        got = tier.fetch(keys, PAGE_BYTES)
        assert all(np.array_equal(np.frombuffer(g, np.uint8), p) for g, p in zip(got, data))
    finally:
        server.stop()


def test_a_reconnect_is_logged_before_waiters_wake(tmp_path, make_tier):
    """`wait_connected` returning means the "reconnected" line is already in the log."""
    from kvtier.testing import redis as harness
    if harness.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = harness.RedisServer(tmp_path / "late")  # not started yet
    tier = make_tier(server.url)
    connected_when_logged: list[bool] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "reconnected" in record.getMessage():
                connected_when_logged.append(tier.connected)

    watch = Watch()
    logging.getLogger("kvtier.tiers.remote").addHandler(watch)
    server.start()
    try:
        assert tier.wait_connected(60), "the remote tier never reconnected"
        assert connected_when_logged == [False]
    finally:
        logging.getLogger("kvtier.tiers.remote").removeHandler(watch)
        server.stop()


def test_close_lets_a_slow_stop_finish(redis_server, make_tier, monkeypatch):
    """A stop that outlasts the drain timeout (a busy machine) is waited for, not cut short: a
    stop cut short left transports half closed, and uvloop's close() then hung in teardown."""
    tier = make_tier(redis_server.url)
    key = scoped_keys(1)[0]
    assert tier.put(key, frame_page(key, pages(1)[0])) and tier.drain()
    finished: list[bool] = []
    real_stop = RemoteTier._stop

    async def slow_stop(self) -> None:
        await asyncio.sleep(0.5)  # the slow part, longer than drain_timeout_s below
        await real_stop(self)
        finished.append(True)

    monkeypatch.setattr(RemoteTier, "_stop", slow_stop)
    tier.close(drain_timeout_s=0.05)
    assert finished == [True]
    assert tier._loop.is_closed()


def test_close_returns_when_the_loop_close_blocks(make_tier, monkeypatch, caplog):
    """A loop whose close() never returns (uvloop waiting on a half-closed transport, seen under
    load) costs close() its deadline and an error line, not the caller's thread for ever."""
    import threading

    from kvtier.tiers import remote as remote_module

    release = threading.Event()
    real_new_loop = remote_module._new_event_loop

    def loop_with_a_stuck_close() -> asyncio.AbstractEventLoop:
        loop = real_new_loop()
        real_close = loop.close

        def stuck_close() -> None:
            release.wait()
            real_close()

        loop.close = stuck_close  # type: ignore[method-assign]
        return loop

    monkeypatch.setattr(remote_module, "_new_event_loop", loop_with_a_stuck_close)
    monkeypatch.setattr(remote_module, "STOP_TIMEOUT_S", 1.0)
    tier = make_tier(f"redis://127.0.0.1:{HARNESS.free_port()}")  # nobody listens: offline
    closer = threading.Thread(target=tier.close, daemon=True)
    try:
        closer.start()
        closer.join(60)
        assert not closer.is_alive(), "close() blocked on the loop's close"
        assert "did not close within" in caplog.text
    finally:
        release.set()
        closer.join(60)


def test_close_aborts_a_connection_no_client_closed(redis_server, make_tier):
    """A socket opened on the tier's loop and dropped by its owner (redis-py drops a cluster
    node that left the slot map without closing its sockets) is aborted at close: uvloop's
    close() of a loop still holding it warned, hung under load, then failed (EBUSY)."""
    from urllib.parse import urlsplit

    tier = make_tier(redis_server.url)
    address = urlsplit(redis_server.url)

    async def open_stray() -> asyncio.StreamWriter:
        _, writer = await asyncio.open_connection(address.hostname, address.port)
        return writer

    stray = asyncio.run_coroutine_threadsafe(open_stray(), tier._loop).result(30)
    tier.close()
    assert tier._loop.is_closed()
    assert stray.transport.is_closing()


def test_close_closes_the_connection_of_a_cluster_node_redis_py_dropped(redis_cluster, make_tier):
    """A node redis-py made and dropped with a connection open (a node that left the slot map
    between two looks at it, kept alive by a reference cycle) is closed at exit: left open, it
    warned when the collector reached it, failing whichever test ran then."""
    from redis.asyncio.cluster import ClusterNode

    tier = make_tier(redis_cluster.url)
    assert tier._connection.wait_connected(30)
    shard = redis_cluster.shards[0]

    async def connect_a_dropped_node():
        # Made as redis-py's slot map refresh makes a node: from the client's own kwargs.
        manager = tier._client.nodes_manager
        seeded = [c for seed in manager.startup_nodes.values() for c in seed._connections]
        assert seeded and all(c in tier._connection._cluster_connections for c in seeded)
        node = ClusterNode("127.0.0.1", shard.port, **manager.connection_kwargs)
        connection = node.acquire_connection()
        await connection.connect()
        return node, connection

    garbage = asyncio.run_coroutine_threadsafe(connect_a_dropped_node(), tier._loop).result(30)
    _, dropped = garbage
    assert dropped.is_connected
    tier.close()
    assert not dropped.is_connected
    del garbage, dropped
    gc.collect()  # nothing warns (filterwarnings = error)


def test_a_request_still_running_at_close_cannot_reopen_the_cluster(redis_cluster, make_tier):
    """A fetch in flight when the tier closes (a store thread's, on the tier's loop) must not
    run on after the connections are closed: redis-py re-initializes a closed cluster client on
    its next command, and the connections it opened then, left open when the loop stopped,
    warned when the collector reached them in a later test (CI, redis-py 8.2)."""
    tier = make_tier(redis_cluster.url)
    assert tier._connection.wait_connected(30)
    client = tier._client
    started = threading.Event()

    async def a_late_request(client=client):
        started.set()
        while not tier._connection.closing or tier._connection.client is not None:
            await asyncio.sleep(0.001)  # until the tier's close has closed the clients
        await client.ping()  # re-initializes the closed client: new nodes, new connections

    late = asyncio.run_coroutine_threadsafe(a_late_request(), tier._loop)
    assert started.wait(30)
    tier.close()
    assert late.cancelled()
    assert client.nodes_manager.default_node is None  # closed, not reopened
    del client, late
    gc.collect()  # nothing warns (filterwarnings = error)
