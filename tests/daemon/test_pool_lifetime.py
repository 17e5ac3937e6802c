"""A pool unregistered, or whose client dies, while a copy into or out of it runs on a copy thread
stays mapped until that copy ends: unmapping a GPU pool under a running kernel is undefined, and
a shared-memory one would be read after its owner let go. The service runs in this process; a
copy is held on an event so the unregister lands mid-copy."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvtier.client import SegmentPool, SharedPool
from kvtier.client.verbs import _layout_spec, _namespace_spec
from kvtier.daemon.service import Service
from kvtier.errors import ProtocolError
from kvtier.ipc import messages as m
from kvtier.pools.layout import PoolLayout


@pytest.fixture(params=["sealed memfd", "named segment"])
def service_with_pool(make_store, namespace, request):
    """A Service over a small store, one session, and one registered 4-page shared pool: a
    sealed memfd (its descriptor received as the server hands one over) or a named segment."""
    store = make_store()
    service = Service(store, copy_threads=1)
    session = service.open_session(os.getuid(), os.getpid())
    layout = PoolLayout.page_first(4, 2, namespace.page_tokens, 2, 16, "bfloat16")
    assert layout.page_bytes == namespace.page_bytes
    sealed = request.param == "sealed memfd"
    shared: SharedPool | SegmentPool = SharedPool(layout) if sealed else SegmentPool(layout)
    if isinstance(shared, SharedPool):
        assert service.pools.fd_budget.try_take(1)  # what the server takes for a received fd
        service.adopt_descriptor(session, os.dup(shared.fd))
    reply = service.handle(session, m.RegisterPool(1, _namespace_spec(namespace), shared.name,
                                                    _layout_spec(layout), descriptor=sealed))
    assert isinstance(reply, m.PoolReply), reply
    yield store, service, session, reply.pool, shared
    service.close_session(session)
    service.executor.shutdown()
    service.remote_executor.shutdown()
    shared.close()


@pytest.mark.parametrize("how", ["unregister", "client death"])
def test_a_pool_let_go_mid_copy_is_unmapped_when_the_copy_ends(
        service_with_pool, namespace, monkeypatch, how: str) -> None:
    store, service, session, pool_id, shared = service_with_pool
    pool = session.pools[pool_id]
    page = np.random.default_rng(3).integers(0, 256, namespace.page_bytes, dtype=np.uint8)
    shared.page(0)[...] = page.reshape(shared.page(0).shape)
    key = bytes(range(16))
    copying, go = threading.Event(), threading.Event()
    store_pages = store.store

    def held_store(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - PageStore.store's own
        copying.set()
        assert go.wait(60)
        return store_pages(*args, **kwargs)

    monkeypatch.setattr(store, "store", held_store)
    replies: list[m._Reply] = []
    copier = threading.Thread(target=lambda: replies.append(
        service.handle(session, m.Store(2, pool_id, [key], [0], None))))
    copier.start()
    try:
        assert copying.wait(60)
        if how == "unregister":
            assert isinstance(service.handle(session, m.UnregisterPool(3, pool_id)), m.Done)
            late = service.handle(session, m.Recall(4, pool_id, [key], [1]))
            assert isinstance(late, m.Error) and "unknown pool" in late.message
        else:
            service.close_session(session)
        assert pool.mapped  # the store still copies out of it
    finally:
        go.set()
        copier.join(60)
    (reply,) = replies
    assert isinstance(reply, m.JobReply) and reply.num_done == 1 and not reply.failed_keys
    assert not pool.mapped  # unmapped by the copy's end
    out = np.zeros((1, namespace.page_bytes), np.uint8)
    assert store.recall(namespace, [key], out).ok and np.array_equal(out[0], page)
    assert store.check() == []


def test_a_copy_that_starts_after_the_unregister_is_refused(service_with_pool) -> None:
    _, _, session, pool_id, _ = service_with_pool
    pool = session.pools[pool_id]
    with pool.in_use():
        pool.close()  # an unregister while a copy holds the pool
        assert pool.mapped
        with pytest.raises(ProtocolError, match="the pool was unregistered"):
            with pool.in_use():
                pass
    assert not pool.mapped
