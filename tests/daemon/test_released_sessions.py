"""What the daemon lets go when a client leaves (its connection and session) dies by reference
counting, through the real service: the heap keeper sweeps the whole heap only when a watched
object outlives its grace (issue #24), so a cycle here would cost a sweep a minute of churn.

The service and server run in this process, on a loop thread, with the collector off."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.client import Client, SharedPool
from kvtier.daemon.server import ControlServer
from kvtier.daemon.service import Service
from kvtier.pools.layout import PoolLayout
from kvtier.store.page_store import PageStore
from kvtier.testing.daemon import poll_until


def test_a_clients_connection_and_session_die_without_the_collector(
        make_store: Callable[..., PageStore], namespace, socket_dir: Path) -> None:
    service = Service(make_store(host_pages=16), copy_threads=1)
    released: list[weakref.ref[Any]] = []
    server = ControlServer(service, max_frame_bytes=1 << 20, max_inflight_per_client=4,
                           watch_released=lambda obj: released.append(weakref.ref(obj)))
    path = socket_dir / "k.sock"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="loop")
    thread.start()
    gc.disable()
    try:
        asyncio.run_coroutine_threadsafe(server.start(str(path)), loop).result(10)
        layout = PoolLayout.page_first(4, 2, namespace.page_tokens, 2, 16, "bfloat16")
        with Client(path, client_name="leaves") as client, SharedPool(layout) as pool:
            handle = pool.register(client, namespace)
            pool.pages[:] = np.random.default_rng(5).integers(0, 256, pool.pages.shape,
                                                              dtype=np.uint8)
            keys = [bytes([i]) * 16 for i in range(4)]
            assert client.store(handle, keys, range(4)).result().ok
            assert client.lookup(handle, keys).num_prefix == 4
            assert client.recall(handle, keys, range(4)).result().ok
        assert poll_until(lambda: len(released) == 2, timeout_s=10.0, interval_s=0.01), (
            "the server did not hand over the connection and its session")
        assert poll_until(lambda: all(ref() is None for ref in released), timeout_s=10.0,
                          interval_s=0.01), (
            f"held by a cycle: {[type(ref()).__name__ for ref in released if ref() is not None]}")
    finally:
        gc.enable()
        asyncio.run_coroutine_threadsafe(server.close(drain_timeout_s=5), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        service.close()
