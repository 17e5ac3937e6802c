"""Every verb end to end: a real daemon, a Client, and a SharedPool standing in for device memory.

One daemon serves the module (64 MiB host tier = 1024 pages of 64 KiB, 256 MiB disk). Each test
uses its own namespace, and pushes pages to disk by storing more than the host tier holds.
Every scenario ends with the daemon's integrity check, bytes verified, returning no problems.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.client import AsyncClient, Client, DaemonReplyError
from kvtier.ipc import messages as m
from kvtier.testing import daemon as harness


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.DaemonProcess]:
    """The harness's module daemon with an LRU host tier: these tests push a test's pages to
    disk by storing never-seen pages after them, which is LRU's order. The default host policy
    (adaptive) may rightly keep older pages it rates denser than new ones."""
    socket_dir = harness.short_socket_dir()
    process = harness.DaemonProcess.start(socket_dir / "k.sock",
                                          tmp_path_factory.mktemp("disk") / "disk",
                                          "--host-policy", "lru")
    try:
        yield process
        process.stop_and_check()
    finally:
        if process.running:
            process.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.fixture
def client(daemon) -> Iterator[Client]:
    with daemon.client("verbs-test") as connected:
        yield connected


@pytest.fixture
def filler(client, make_pool) -> harness.Filler:
    return harness.Filler(client, make_pool(harness.make_layout("page-first", 256)))


@pytest.mark.parametrize("kind", ["page-first", "layer-first"])
def test_store_then_recall_into_other_pages_is_byte_identical(daemon, client, make_pool,
                                                               kind: str) -> None:
    rng = np.random.default_rng(1)
    layout = harness.make_layout(kind, 64)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, f"roundtrip-{kind}", kind))
    harness.fill_random(pool, rng, range(64))
    keys = harness.random_keys(rng, 24)
    stored = harness.snapshot(pool, range(24))

    result = client.store(handle, keys, range(24)).result()
    assert (result.num_done, result.failed) == (24, {})
    lookup = client.lookup(handle, keys)
    assert lookup.num_prefix == 24
    assert lookup.tiers == ["host"] * 24

    before = harness.snapshot(pool, range(64))
    targets = [63, 40, 33, 57, 26, 48, 30, 61]  # scattered, out of order
    chosen = [3, 0, 17, 23, 9, 11, 5, 20]
    recalled = client.recall(handle, [keys[i] for i in chosen], targets).result()

    assert recalled.ok and recalled.num_done == len(chosen)
    assert recalled.tiers == ["host"] * len(chosen)
    for key_index, page_id in zip(chosen, targets):
        np.testing.assert_array_equal(pool.pages[page_id], stored[key_index])
    untouched = [i for i in range(64) if i not in targets]
    np.testing.assert_array_equal(harness.snapshot(pool, untouched), before[untouched])
    harness.assert_sound(client)


def test_lookup_reports_the_present_prefix_and_each_tier(client, make_pool) -> None:
    rng = np.random.default_rng(2)
    layout = harness.make_layout("page-first", 8)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "lookup"))
    harness.fill_random(pool, rng, range(8))
    keys = harness.random_keys(rng, 8)
    assert client.store(handle, keys[:3] + keys[4:6], [0, 1, 2, 4, 5]).result().ok

    reply = client.lookup(handle, keys)

    assert reply.num_prefix == 3
    assert reply.tiers == ["host", "host", "host", None, "host", "host", None, None]
    assert client.lookup(handle, []).num_prefix == 0
    harness.assert_sound(client)


def test_page_evicted_to_disk_is_recalled_from_disk_byte_identical(client, make_pool,
                                                                   filler) -> None:
    rng = np.random.default_rng(3)
    layout = harness.make_layout("layer-first", 32)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "evicted", "layer-first"))
    harness.fill_random(pool, rng, range(32))
    keys = harness.random_keys(rng, 16)
    stored = harness.snapshot(pool, range(16))
    assert client.store(handle, keys, range(16)).result().ok

    filler.overflow_host()

    assert client.lookup(handle, keys).tiers == ["disk"] * 16
    before = harness.snapshot(pool, range(32))
    recalled = client.recall(handle, keys, range(16, 32)).result()
    assert recalled.ok and recalled.tiers == ["disk"] * 16
    np.testing.assert_array_equal(harness.snapshot(pool, range(16, 32)), stored)
    np.testing.assert_array_equal(harness.snapshot(pool, range(16)), before[:16])
    assert client.lookup(handle, keys).tiers == ["host"] * 16  # a disk hit is promoted
    harness.assert_sound(client)


def test_prefetch_brings_disk_pages_up_to_host(client, make_pool, filler) -> None:
    rng = np.random.default_rng(4)
    layout = harness.make_layout("page-first", 16)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "prefetch"))
    harness.fill_random(pool, rng, range(16))
    keys = harness.random_keys(rng, 8)
    absent = harness.random_keys(rng, 2)
    stored = harness.snapshot(pool, range(8))
    assert client.store(handle, keys, range(8)).result().ok
    filler.overflow_host()
    assert client.lookup(handle, keys).tiers == ["disk"] * 8

    result = client.prefetch(handle, keys + absent).result()

    assert result.num_done == 8 and result.failed == {}
    assert sorted(result.missing) == sorted(absent)
    assert client.lookup(handle, keys).tiers == ["host"] * 8
    recalled = client.recall(handle, keys, range(8, 16)).result()
    assert recalled.tiers == ["host"] * 8
    np.testing.assert_array_equal(harness.snapshot(pool, range(8, 16)), stored)
    harness.assert_sound(client)


def test_pinned_pages_stay_in_host_until_unpinned(client, make_pool, filler) -> None:
    rng = np.random.default_rng(5)
    layout = harness.make_layout("page-first", 8)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "pin"))
    harness.fill_random(pool, rng, range(8))
    keys = harness.random_keys(rng, 4)
    absent = harness.random_keys(rng, 1)
    assert client.store(handle, keys, range(4)).result().ok
    leases_before = client.stats()["num_leases"]

    lease, missing = client.pin(handle, keys + absent, ttl_s=3600.0)

    assert missing == absent
    assert client.stats()["num_leases"] == leases_before + 1
    assert [c["leases"] for c in client.stats()["clients"]
            if c["client_id"] == client.client_id] == [1]
    filler.overflow_host()
    assert client.lookup(handle, keys).tiers == ["host"] * 4

    client.unpin(lease)

    assert client.stats()["num_leases"] == leases_before
    with pytest.raises(DaemonReplyError) as refused:
        client.unpin(lease)
    assert refused.value.code == "bad_request"
    filler.overflow_host()
    assert client.lookup(handle, keys).tiers == ["disk"] * 4
    harness.assert_sound(client)


def test_delete_removes_pages_from_every_tier(client, make_pool, filler) -> None:
    rng = np.random.default_rng(6)
    layout = harness.make_layout("page-first", 16)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "delete"))
    harness.fill_random(pool, rng, range(16))
    on_disk, in_host = harness.random_keys(rng, 4), harness.random_keys(rng, 4)
    assert client.store(handle, on_disk, range(4)).result().ok
    filler.overflow_host()
    assert client.store(handle, in_host, range(4, 8)).result().ok
    assert client.lookup(handle, on_disk + in_host).tiers == ["disk"] * 4 + ["host"] * 4

    assert client.delete(handle, on_disk + in_host) == 8

    assert client.lookup(handle, on_disk + in_host).tiers == [None] * 8
    assert client.delete(handle, on_disk + in_host) == 0
    before = harness.snapshot(pool, range(16))
    recalled = client.recall(handle, on_disk + in_host, range(8, 16)).result()
    assert recalled.num_done == 0 and sorted(recalled.missing) == sorted(on_disk + in_host)
    np.testing.assert_array_equal(harness.snapshot(pool, range(16)), before)
    harness.assert_sound(client)


def test_stats_report_tiers_lanes_latency_and_clients(daemon, client, make_pool) -> None:
    rng = np.random.default_rng(7)
    layout = harness.make_layout("page-first", 4)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "stats"))
    harness.fill_random(pool, rng, range(4))
    keys = harness.random_keys(rng, 2)
    assert client.store(handle, keys, [0, 1]).result().ok
    assert client.recall(handle, keys, [2, 3]).result().ok
    client.lookup(handle, keys)

    stats = client.stats()

    assert {tier["tier"] for tier in stats["tiers"]} == {"host", "disk"}
    host = next(tier for tier in stats["tiers"] if tier["tier"] == "host")
    assert host["capacity_bytes"] == harness.HOST_CAPACITY_BYTES
    assert 0 < host["used_bytes"] <= host["capacity_bytes"]
    assert stats["lanes"]["store"]["bytes"] >= 2 * layout.page_bytes
    assert stats["lanes"]["recall"]["bytes"] >= 2 * layout.page_bytes
    assert stats["lanes"]["store"]["gbps"] > 0
    for verb in ("hello", "register_pool", "store", "recall", "lookup"):
        figures = stats["latency"][verb]
        assert figures["count"] >= 1 and 0 < figures["p50_us"] <= figures["p99_us"]
    mine = [c for c in stats["clients"] if c["client_id"] == client.client_id]
    assert mine == [{"client_id": client.client_id, "name": "verbs-test", "pid": os.getpid(),
                     "uid": os.getuid(), "pools": 1, "leases": 0}]
    assert stats["num_leases"] == 0
    harness.assert_sound(client)


def test_pipelined_stores_each_get_their_own_result(client, make_pool) -> None:
    rng = np.random.default_rng(8)
    layout = harness.make_layout("page-first", 64)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "pipelined"))
    harness.fill_random(pool, rng, range(64))
    batches = [harness.random_keys(rng, size) for size in (1, 7, 3, 12, 5, 8)]
    page_starts = [0, 1, 8, 11, 23, 28]

    jobs = [client.store(handle, keys, range(start, start + len(keys)))
            for keys, start in zip(batches, page_starts)]
    refused = client.store(handle, harness.random_keys(rng, 1), [64])  # out of range
    again = client.store(handle, batches[1], range(1, 8))  # already present: still done

    assert client.lookup(handle, []).num_prefix == 0  # a call between sends and waits
    with pytest.raises(DaemonReplyError) as error:
        refused.result()
    assert error.value.code == "bad_request" and "out of range" in str(error.value)
    assert again.result().num_done == 7
    for job, keys in reversed(list(zip(jobs, batches))):
        result = job.result()
        assert (result.num_done, result.failed) == (len(keys), {})
    for keys in batches:
        assert client.lookup(handle, keys).tiers == ["host"] * len(keys)
    recalled = client.recall(handle, batches[3], range(40, 52)).result()
    assert recalled.ok
    np.testing.assert_array_equal(harness.snapshot(pool, range(40, 52)),
                                  harness.snapshot(pool, range(11, 23)))
    harness.assert_sound(client)


def test_recall_writes_only_the_pages_of_present_keys(client, make_pool) -> None:
    rng = np.random.default_rng(9)
    layout = harness.make_layout("layer-first", 32)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "partial", "layer-first"))
    harness.fill_random(pool, rng, range(32))
    present = harness.random_keys(rng, 6)
    absent = harness.random_keys(rng, 5)
    stored = harness.snapshot(pool, range(6))
    assert client.store(handle, present, range(6)).result().ok
    mix = [present[0], absent[0], absent[1], present[1], present[2], absent[2], present[3],
           absent[3], present[4], present[5], absent[4]]
    targets = list(range(16, 16 + len(mix)))
    before = harness.snapshot(pool, range(32))

    result = client.recall(handle, mix, targets).result()

    assert not result.ok and result.num_done == 6 and result.failed == {}
    assert sorted(result.missing) == sorted(absent)
    assert result.tiers == ["host" if key in present else None for key in mix]
    for key, page_id in zip(mix, targets):
        expected = stored[present.index(key)] if key in present else before[page_id]
        np.testing.assert_array_equal(pool.pages[page_id], expected)
    untouched = [i for i in range(32) if i not in targets]
    np.testing.assert_array_equal(harness.snapshot(pool, untouched), before[untouched])
    harness.assert_sound(client)


def test_async_client_serves_concurrent_lookups_stores_and_recalls(daemon, client,
                                                                   make_pool) -> None:
    rng = np.random.default_rng(10)
    layout = harness.make_layout("page-first", 64)
    pool = make_pool(layout)
    namespace = harness.namespace_for(layout, "async")
    harness.fill_random(pool, rng, range(64))
    batches = [harness.random_keys(rng, 4) for _ in range(8)]
    stored = harness.snapshot(pool, range(32))

    async def scenario() -> None:
        aclient = await AsyncClient.connect(daemon.socket_path, client_name="async-test")
        try:
            handle = await aclient.register_sealed_pool(namespace, pool.fd, layout, pool.name)
            stores = await asyncio.gather(*(
                aclient.store(handle, keys, range(4 * i, 4 * i + 4))
                for i, keys in enumerate(batches)))
            assert [(r.num_done, r.failed) for r in stores] == [(4, {})] * 8
            lookups = await asyncio.gather(*(aclient.lookup(handle, keys) for keys in batches),
                                           aclient.ping(), aclient.stats())
            assert [reply.num_prefix for reply in lookups[:8]] == [4] * 8
            assert any(c["name"] == "async-test" for c in lookups[9]["clients"])
            recalls = await asyncio.gather(*(
                aclient.recall(handle, keys, range(32 + 4 * i, 36 + 4 * i))
                for i, keys in enumerate(batches)))
            assert all(r.ok and r.tiers == ["host"] * 4 for r in recalls)
            with pytest.raises(DaemonReplyError):
                await aclient.recall(handle, batches[0], [0])
            assert await aclient.check(verify_bytes=True) == []
        finally:
            await aclient.close()

    asyncio.run(scenario())

    np.testing.assert_array_equal(harness.snapshot(pool, range(32, 64)), stored)
    harness.assert_sound(client)


def test_host_arena_is_mappable_read_only_by_clients(client) -> None:
    from kvtier.shm import SharedSegment

    assert client.arena_segment is not None
    arena = SharedSegment.attach(client.arena_segment)  # read-only by default
    try:
        view = arena.array()
        assert view.nbytes == harness.HOST_CAPACITY_BYTES and not view.flags.writeable
        with pytest.raises((TypeError, ValueError)):
            view[0] = 1
    finally:
        del view
        arena.close()


def test_open_namespace_looks_up_what_a_pool_stored_and_refuses_copies(daemon, client,
                                                                        make_pool) -> None:
    rng = np.random.default_rng(7)
    layout = harness.make_layout("page-first", 8)
    pool = make_pool(layout)
    namespace = harness.namespace_for(layout, "open-namespace")
    handle = pool.register(client, namespace)
    keys = harness.random_keys(rng, 8)
    harness.fill_random(pool, rng, range(8))
    assert client.store(handle, keys[:5], range(5)).result().ok
    with daemon.client("scheduler") as scheduler:
        names = scheduler.open_namespace(namespace)
        assert scheduler.lookup(names, keys).num_prefix == 5
        other = scheduler.open_namespace(harness.namespace_for(layout, "open-namespace-other"))
        assert scheduler.lookup(other, keys).num_prefix == 0
        with pytest.raises(DaemonReplyError, match="holds no pages"):
            scheduler.recall(names, keys[:1], [0]).result()
        with pytest.raises(DaemonReplyError, match="holds no pages"):
            scheduler.store(names, keys[5:6], [5]).result()
    harness.assert_sound(client)


def test_a_thread_waiting_on_a_reply_does_not_hold_up_another_threads_calls(daemon,
                                                                              client) -> None:
    # The waiting thread reads the socket for a reply that comes only when the main thread
    # sends its request: the main thread's own call must get through meanwhile.
    late = m.Ping(client._next_id())
    waited: list[object] = []
    waiter = threading.Thread(target=lambda: waited.append(client._wait(late.id)))
    waiter.start()
    try:
        harness.wait_until(lambda: client._router._reading, "the waiting thread reads the socket")
        client.ping()
        assert client.lookup(client.open_namespace(harness.namespace_for(
            harness.make_layout("page-first", 1), "threads")), [b"k" * 16]).num_prefix == 0
    finally:
        client._send(late)
        waiter.join(30)
    assert not waiter.is_alive() and len(waited) == 1
