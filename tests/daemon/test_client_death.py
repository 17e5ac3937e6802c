"""A client that dies holding pins, a pool and a store in flight leaves nothing behind.

The doomed client is a separate process killed with SIGKILL, so it never says goodbye. The daemon
must notice from the closed socket alone: drop its session, release its leases (its pinned pages
become evictable again), unmap its pool and close its socket, while another client carries on.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvtier.testing import daemon as harness

NUM_PINNED = 64
NUM_IN_FLIGHT = 512

DOOMED_CLIENT = """
import sys
import numpy as np
from kvtier.client import Client, SharedPool
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout

socket_path, model_id, num_pinned, num_in_flight = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
layout = PoolLayout.page_first(num_in_flight, 4, 16, 4, 64, "float16")
namespace = Namespace(model_id, "float16", "page-first", 16, layout.page_bytes)
pool = SharedPool(layout)
pool.pages[:] = np.random.default_rng(0).integers(0, 256, pool.pages.shape, dtype=np.uint8)
client = Client(socket_path, client_name="doomed")
handle = pool.register(client, namespace)
pinned = [b"pinned-key-%05d" % i for i in range(num_pinned)]
assert client.store(handle, pinned, range(num_pinned)).result().ok
lease, missing = client.pin(handle, pinned, 3600.0)
assert not missing
client.store(handle, [b"flight-key-%05d" % i for i in range(num_in_flight)], range(num_in_flight))
print(pool.name, flush=True)
sys.stdin.read()  # killed here, with the store above possibly still running
"""


def doomed_clients(stats: dict) -> list[dict]:
    return [c for c in stats["clients"] if c["name"] == "doomed"]


def test_killed_client_releases_leases_pool_and_socket(make_daemon, socket_dir: Path,
                                                       tmp_path: Path, make_pool) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    rng = np.random.default_rng(11)
    layout = harness.make_layout("page-first", 256)
    namespace = harness.namespace_for(layout, "doomed-model")
    pinned = [b"pinned-key-%05d" % i for i in range(NUM_PINNED)]
    with daemon.client("survivor") as survivor:
        pool = make_pool(layout)
        handle = pool.register(survivor, namespace)
        filler = harness.Filler(survivor, make_pool(harness.make_layout("page-first", 256)))
        filler.overflow_host()  # warm up: the disk tier has its files open from here on
        harness.fill_random(pool, rng, range(256))
        own_keys = harness.random_keys(rng, 8)
        own_pages = harness.snapshot(pool, range(8))
        assert survivor.store(handle, own_keys, range(8)).result().ok
        baseline_fds = daemon.num_open_fds()
        baseline_segments = daemon.held_pool_segments()
        assert baseline_segments == {pool.name, filler._pool.name}

        doomed = subprocess.Popen(
            [sys.executable, "-c", DOOMED_CLIENT, str(daemon.socket_path), "doomed-model",
             str(NUM_PINNED), str(NUM_IN_FLIGHT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            segment = harness.readline_within(doomed.stdout, 60.0).strip()
            assert segment.startswith("kvtier-pool-"), f"the doomed client failed: {segment!r}"
            stats = survivor.stats()
            assert [(c["pools"], c["leases"]) for c in doomed_clients(stats)] == [(1, 1)]
            assert stats["num_leases"] == 1
            assert segment in daemon.held_pool_segments()
            assert survivor.lookup(handle, own_keys).tiers == ["host"] * 8  # unaffected

            doomed.send_signal(signal.SIGKILL)
            assert doomed.wait(30) == -signal.SIGKILL
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait(30)
            doomed.stdin.close()
            doomed.stdout.close()
            harness.remove_shm_segments(f"kvtier-pool-{doomed.pid}-")

        harness.wait_until(lambda: not doomed_clients(survivor.stats()),
                           "the daemon to drop the killed client's session")
        assert survivor.stats()["num_leases"] == 0
        assert daemon.num_open_fds() == baseline_fds
        assert daemon.held_pool_segments() == baseline_segments

        recalled = survivor.recall(handle, own_keys, range(8, 16)).result()
        assert recalled.ok
        np.testing.assert_array_equal(harness.snapshot(pool, range(8, 16)), own_pages)
        assert survivor.lookup(handle, pinned).tiers == ["host"] * NUM_PINNED
        filler.overflow_host()
        assert survivor.lookup(handle, pinned).tiers == ["disk"] * NUM_PINNED  # pins are gone
        assert survivor.check() == []
        assert survivor.check(verify_bytes=True) == []
