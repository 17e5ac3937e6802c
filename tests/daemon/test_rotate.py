"""The rotate verb end to end: a real daemon swaps pages of paused requests out of a pool and pages
of resumed ones into it, in one call, on both lanes; a swap-in may take the very pages just
swapped out. Every scenario ends with the daemon's integrity check, bytes verified."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.client import AsyncClient, Client
from kvtier.testing import daemon as harness


@pytest.fixture
def client(daemon) -> Iterator[Client]:
    with daemon.client("rotate-test") as connected:
        yield connected


@pytest.mark.parametrize("kind", ["page-first", "layer-first"])
def test_rotate_swaps_paused_pages_out_and_resumed_ones_into_the_freed_pages(
        client, make_pool, kind: str) -> None:
    rng = np.random.default_rng(21)
    layout = harness.make_layout(kind, 32)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, f"rotate-{kind}", kind))
    harness.fill_random(pool, rng, range(32))
    resumed_keys = harness.random_keys(rng, 8)
    assert client.store(handle, resumed_keys, range(8)).result().ok  # a request paused earlier
    resumed = harness.snapshot(pool, range(8))
    harness.fill_random(pool, rng, range(32))  # the pool moved on: other requests run there
    paused_pages = [8, 9, 10, 11, 12, 13]
    paused = harness.snapshot(pool, paused_pages)
    before = harness.snapshot(pool, range(32))
    paused_keys = harness.random_keys(rng, 6)
    # Resumed pages land in the slots just freed (8..13) and two others (30, 31).
    into = [13, 12, 11, 10, 9, 8, 30, 31]

    result = client.rotate(handle, paused_keys, paused_pages, resumed_keys, into).result()

    assert result.ok, result
    assert (result.stored.num_done, result.recalled.num_done) == (6, 8)
    assert result.recalled.tiers == ["host"] * 8
    for index, page in enumerate(into):
        np.testing.assert_array_equal(pool.pages[page], resumed[index])
    untouched = [p for p in range(32) if p not in into]
    np.testing.assert_array_equal(harness.snapshot(pool, untouched), before[untouched])
    # The paused pages were saved before being overwritten: they come back intact.
    assert client.recall(handle, paused_keys, range(16, 22)).result().ok
    np.testing.assert_array_equal(harness.snapshot(pool, range(16, 22)), paused)
    stats = client.stats()
    assert stats["lanes"]["store"]["bytes"] > 0 and stats["lanes"]["recall"]["bytes"] > 0
    harness.assert_sound(client)


def test_rotate_reports_missing_and_already_present_keys(client, make_pool) -> None:
    rng = np.random.default_rng(22)
    layout = harness.make_layout("page-first", 16)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "rotate-missing"))
    harness.fill_random(pool, rng, range(16))
    present = harness.random_keys(rng, 2)
    assert client.store(handle, present, [0, 1]).result().ok
    unknown = harness.random_keys(rng, 1)
    before = harness.snapshot(pool, range(16))

    result = client.rotate(handle, present + harness.random_keys(rng, 1), [0, 1, 2],
                           [present[1], unknown[0]], [2, 3]).result()

    assert result.stored.num_done == 3 and result.stored.failed == {}
    assert result.recalled.missing == unknown and result.recalled.num_done == 1
    assert result.recalled.tiers == ["host", None]
    np.testing.assert_array_equal(pool.pages[2], before[1])
    np.testing.assert_array_equal(pool.pages[3], before[3])  # a miss leaves its page alone
    harness.assert_sound(client)


def test_rotate_brings_disk_pages_in_after_the_swap_out(daemon, client, make_pool) -> None:
    rng = np.random.default_rng(23)
    layout = harness.make_layout("layer-first", 16)
    pool = make_pool(layout)
    handle = pool.register(client, harness.namespace_for(layout, "rotate-disk", "layer-first"))
    harness.fill_random(pool, rng, range(16))
    old_keys = harness.random_keys(rng, 4)
    assert client.store(handle, old_keys, range(4)).result().ok
    old = harness.snapshot(pool, range(4))
    harness.Filler(client, make_pool(harness.make_layout("page-first", 256))).overflow_host()
    assert client.lookup(handle, old_keys).tiers == ["disk"] * 4
    harness.fill_random(pool, rng, range(16))
    paused = harness.snapshot(pool, [4, 5, 6, 7])
    paused_keys = harness.random_keys(rng, 4)

    result = client.rotate(handle, paused_keys, [4, 5, 6, 7], old_keys, [7, 6, 5, 4]).result()

    assert result.ok, result
    assert result.recalled.tiers == ["disk"] * 4
    np.testing.assert_array_equal(harness.snapshot(pool, [7, 6, 5, 4]), old)
    assert client.recall(handle, paused_keys, [8, 9, 10, 11]).result().ok
    np.testing.assert_array_equal(harness.snapshot(pool, [8, 9, 10, 11]), paused)
    harness.assert_sound(client)


def test_rotate_from_the_async_client_and_bad_page_ids(daemon, make_pool) -> None:
    rng = np.random.default_rng(24)
    layout = harness.make_layout("page-first", 8)
    namespace = harness.namespace_for(layout, "rotate-async")
    pool = make_pool(layout)
    harness.fill_random(pool, rng, range(8))
    keys = harness.random_keys(rng, 4)

    async def run() -> None:
        aclient = await AsyncClient.connect(daemon.socket_path, client_name="rotate-async")
        try:
            handle = await aclient.register_sealed_pool(namespace, pool.fd, layout, pool.name)
            first = await aclient.rotate(handle, keys[:2], [0, 1], [], [])
            assert first.ok and first.stored.num_done == 2
            second = await aclient.rotate(handle, keys[2:], [2, 3], keys[:2], [2, 3])
            assert second.ok and second.recalled.tiers == ["host", "host"]
            with pytest.raises(Exception, match="out of range"):
                await aclient.rotate(handle, keys[:1], [99], [], [])
            with pytest.raises(Exception, match="page ids"):
                await aclient.rotate(handle, keys[:2], [0], [], [])
            assert await aclient.check(verify_bytes=True) == []
        finally:
            await aclient.close()

    saved = harness.snapshot(pool, [0, 1])
    asyncio.run(run())
    np.testing.assert_array_equal(harness.snapshot(pool, [2, 3]), saved)
