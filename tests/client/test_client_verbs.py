"""Both clients serve the same verbs, each request built once (`kvtier.client.verbs`).

The README promises `AsyncClient` has `Client`'s verbs; it lacked `register_device_pool` and
`unregister_pool` while each verb's request was written twice. These tests hold the two to one
list, and run the two verbs it gained against a real daemon.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
from dataclasses import dataclass

import numpy as np
import pytest

from kvtier.client import CLIENT_VERBS, AsyncClient, Client, DaemonReplyError, verbs
from kvtier.testing import daemon as harness


def public_methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


def test_both_clients_expose_the_same_verbs() -> None:
    assert public_methods(Client) - {"close"} == set(CLIENT_VERBS)
    assert public_methods(AsyncClient) - {"close", "connect"} == set(CLIENT_VERBS)
    assert all(inspect.iscoroutinefunction(getattr(AsyncClient, verb)) for verb in CLIENT_VERBS)


def test_each_verb_is_built_in_one_place_with_the_clients_arguments() -> None:
    """Each client method takes what its builder in `verbs` takes (besides the request id)."""
    for verb in CLIENT_VERBS:
        builder = list(inspect.signature(getattr(verbs, verb)).parameters)[1:]
        for cls in (Client, AsyncClient):
            assert list(inspect.signature(getattr(cls, verb)).parameters)[1:] == builder, (
                cls.__name__, verb)


def test_async_client_unregisters_a_pool(daemon, make_pool) -> None:
    rng = np.random.default_rng(21)
    layout = harness.make_layout("page-first", 8)
    pool = make_pool(layout)
    namespace = harness.namespace_for(layout, "async-unregister")
    harness.fill_random(pool, rng, range(8))
    keys = harness.random_keys(rng, 4)

    async def scenario() -> None:
        aclient = await AsyncClient.connect(daemon.socket_path, client_name="async-unregister")
        try:
            handle = await aclient.register_sealed_pool(namespace, pool.fd, layout, pool.name)
            assert (await aclient.store(handle, keys, range(4))).ok

            def my_pools(stats: dict) -> int:
                return next(c["pools"] for c in stats["clients"]
                            if c["name"] == "async-unregister")

            assert my_pools(await aclient.stats()) == 1
            await aclient.unregister_pool(handle)
            assert my_pools(await aclient.stats()) == 0
            with pytest.raises(DaemonReplyError) as refused:
                await aclient.recall(handle, keys, range(4, 8))
            assert refused.value.code == "bad_request"
            assert (await aclient.lookup(await aclient.open_namespace(namespace), keys)
                    ).num_prefix == 4  # the pages stay stored: only the pool went
        finally:
            await aclient.close()

    asyncio.run(scenario())
    with daemon.client("async-unregister-check") as client:
        harness.assert_sound(client)


@dataclass(slots=True, frozen=True)
class MadeUpDeviceMemory:
    """What `register_device_pool` reads of a `DeviceMemory`, with a handle no GPU issued: the
    daemon (the peer, real) must refuse it; the request the client built is under test."""

    ipc_handle: bytes
    device: int
    size_bytes: int
    ipc_offset: int
    pci_bus_id: str


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed: the daemon would try to open the handle")
def test_async_client_registers_a_device_pool_and_hears_why_it_is_refused(daemon) -> None:
    layout = harness.make_layout("page-first", 8)
    namespace = harness.namespace_for(layout, "async-device")
    memory = MadeUpDeviceMemory(bytes(64), 0, layout.span_bytes, 0, "")

    async def scenario() -> None:
        aclient = await AsyncClient.connect(daemon.socket_path, client_name="async-device")
        try:
            with pytest.raises(DaemonReplyError) as refused:
                await aclient.register_device_pool(namespace, memory, layout)
            assert refused.value.code == "backend_unavailable"
            assert "CuPy" in str(refused.value)
            await aclient.ping()  # the connection carries on
        finally:
            await aclient.close()

    asyncio.run(scenario())


@pytest.mark.gpu
def test_async_client_device_pool_store_and_recall_are_byte_identical(daemon, cupy) -> None:
    from kvtier.client import DeviceMemory

    layout = harness.make_layout("layer-first", 16)
    namespace = harness.namespace_for(layout, "async-device-gpu", "layer-first")
    memory = DeviceMemory.allocate(layout)
    pages = memory.pages(layout)
    source = np.random.default_rng(5).integers(0, 256, (8, *pages.shape[1:]), dtype=np.uint8)
    pages[:8] = cupy.asarray(source)
    cupy.cuda.get_current_stream().synchronize()  # landed before the daemon reads the pool
    keys = harness.random_keys(np.random.default_rng(6), 8)

    async def scenario() -> None:
        aclient = await AsyncClient.connect(daemon.socket_path, client_name="async-device-gpu")
        try:
            handle = await aclient.register_device_pool(namespace, memory, layout)
            assert (await aclient.store(handle, keys, range(8))).ok
            assert (await aclient.recall(handle, keys, range(8, 16))).ok
            await aclient.unregister_pool(handle)
        finally:
            await aclient.close()

    asyncio.run(scenario())
    np.testing.assert_array_equal(cupy.asnumpy(pages[8:16]), source)
