"""The daemon gives back the memory of pages deleted (issue #24): the host arena's chunks left
with no page are punched out of /dev/shm, so the system has them again, and the daemon's RSS
falls back by what the pages took. Before, the arena's memory stayed resident for ever after a
large store, its pages deleted."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from kvtier.client import SharedPool
from kvtier.shm import SHM_DIR
from kvtier.testing import daemon as harness

NUM_PAGES = 512  # of 64 KiB: 32 MiB, half the test daemon's host tier
STORED_BYTES = NUM_PAGES * harness.PAGE_BYTES


def arena_file_bytes(pid: int) -> int:
    """Memory the daemon's host arena holds in /dev/shm."""
    (path,) = SHM_DIR.glob(f"kvtier-host-{pid}-*")
    return os.stat(path).st_blocks * 512


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) << 10


def test_deleted_pages_give_their_memory_back(make_daemon, socket_dir: Path,
                                              tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    layout = harness.make_layout("page-first", NUM_PAGES)
    with daemon.client() as client, SharedPool(layout) as pool:
        handle = pool.register(client, harness.namespace_for(layout, "given-back"))
        harness.fill_random(pool, np.random.default_rng(0), range(NUM_PAGES))
        keys = harness.random_keys(np.random.default_rng(1), NUM_PAGES)
        assert client.store(handle, keys, range(NUM_PAGES)).result().ok
        stored_arena_bytes = arena_file_bytes(daemon.pid)
        stored_rss_bytes = resident_bytes(daemon.pid)
        assert client.delete(handle, keys) == NUM_PAGES
        # Housekeeping (every second) gives idle chunks back; a chunk may stay partly held.
        arena_given_back = harness.poll_until(
            lambda: arena_file_bytes(daemon.pid) <= stored_arena_bytes - STORED_BYTES * 3 // 4,
            timeout_s=15.0, interval_s=0.1)
        rss_given_back = harness.poll_until(
            lambda: resident_bytes(daemon.pid) <= stored_rss_bytes - STORED_BYTES // 2,
            timeout_s=15.0, interval_s=0.1)
        # The memory comes back when pages are stored again, and so do their bytes.
        assert client.store(handle, keys, range(NUM_PAGES)).result().ok
        before = harness.snapshot(pool, range(NUM_PAGES))
        pool.pages[:] = 0
        assert client.recall(handle, keys, range(NUM_PAGES)).result().ok
        assert (harness.snapshot(pool, range(NUM_PAGES)) == before).all()
        harness.assert_sound(client)
    assert arena_given_back, (f"the arena holds {arena_file_bytes(daemon.pid) >> 20} MiB after "
                              f"its {STORED_BYTES >> 20} MiB of pages were deleted (held "
                              f"{stored_arena_bytes >> 20} MiB with them)")
    assert rss_given_back, (f"daemon RSS {resident_bytes(daemon.pid) >> 20} MiB after the delete, "
                            f"{stored_rss_bytes >> 20} MiB with the pages")
