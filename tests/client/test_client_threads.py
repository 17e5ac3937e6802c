"""One `Client` shared by many threads: pipelined requests each get their own reply, whichever
thread happens to read the socket."""

from __future__ import annotations

import threading

import numpy as np

from kvtier.testing import daemon as harness

NUM_THREADS = 8
CALLS_PER_THREAD = 150


def test_threads_sharing_a_client_each_get_their_own_replies(daemon, make_pool) -> None:
    layout = harness.make_layout("page-first", 16)
    namespace = harness.namespace_for(layout, "client-threads")
    keys = harness.random_keys(np.random.default_rng(11), 16)
    absent = harness.random_keys(np.random.default_rng(12), NUM_THREADS)
    with daemon.client("threads") as client:
        pool = make_pool(layout)
        handle = pool.register(client, namespace)
        harness.fill_random(pool, np.random.default_rng(13), range(16))
        assert client.store(handle, keys, list(range(16))).result().ok
        wrong: list[tuple[int, int]] = []
        failures: list[BaseException] = []

        def ask(thread: int) -> None:
            # Each thread's lookups stop at its own absent key: a reply handed to the wrong
            # thread shows as a wrong prefix.
            query = keys[:thread + 1] + [absent[thread]] + keys
            try:
                for call in range(CALLS_PER_THREAD):
                    if call % 10 == 0:
                        client.ping()
                    found = client.lookup(handle, query).num_prefix
                    if found != thread + 1:
                        wrong.append((thread, found))
            except BaseException as exc:  # surfaced in the test's thread
                failures.append(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not failures, failures
        assert not wrong, wrong[:10]
        router = client._router
        assert not router._replies  # every reply was taken by its thread
        assert not router._sleepers and not router._reading
        client.unregister_pool(handle)
