"""The lookup plane: the index a client maps agrees with the daemon's page table through
concurrent stores, evictions, deletes, rebuilds and a restart, and a client cannot write it."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.client.local_lookup import MappedIndex, open_index
from kvtier.daemon import lookup_plane
from kvtier.daemon.lookup_plane import BACKGROUND_KEYS, LookupPlane
from kvtier.ipc import messages as m
from kvtier.key_index import MAX_LOAD
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.store.pages import PageEntry
from kvtier.testing import daemon as harness

from ..conftest import random_keys, random_pages
from ..test_key_index import homed_key


def mapped(plane: LookupPlane, namespace: Namespace) -> MappedIndex:
    """The namespace's index as a client maps it (this process plays the daemon's pid)."""
    fd, generation, size_bytes = plane.index_for(namespace)
    return open_index(os.getpid(), os.getuid(), fd, generation, size_bytes,
                      namespace.fingerprint)


def assert_agrees(store: PageStore, plane: LookupPlane, namespace: Namespace,
                  keys: list[bytes]) -> int:
    """Each key is in the index exactly when the store's lookup finds it; returns how many."""
    index = mapped(plane, namespace)
    held = [tier is not None for tier in store.lookup(namespace, keys).tiers]
    indexed = [index.longest_prefix([key]) == 1 for key in keys]
    assert indexed == held
    index.close()
    return sum(held)


@pytest.mark.parametrize("background_keys", [BACKGROUND_KEYS, 1], ids=["locked", "background"])
def test_the_index_follows_stores_evictions_deletes_and_rebuilds(make_store, namespace,
                                                                 background_keys: int) -> None:
    store = make_store(host_pages=32, disk_pages=96)
    plane = LookupPlane(store, background_keys=background_keys)
    keys = random_keys(400, seed=3)
    pages = random_pages(8, seed=4)
    generations = set()
    failures: list[BaseException] = []

    def worker(seed: int, action: str) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                chosen = [keys[int(i)] for i in rng.choice(len(keys), 8, replace=False)]
                if action == "store":
                    store.store(namespace, chosen, pages)
                elif action == "delete":
                    store.delete(namespace, chosen[:2])
                else:
                    store.recall(namespace, chosen, np.empty_like(pages))
        except BaseException as exc:  # surfaced below, in the test's thread
            failures.append(exc)

    for round_ in range(3):
        threads = [threading.Thread(target=worker, args=(10 * round_ + i, action))
                   for i, action in enumerate(("store", "store", "delete", "recall"))]
        for thread in threads:
            thread.start()
        reader = mapped(plane, namespace)
        while any(thread.is_alive() for thread in threads):
            answer = reader.longest_prefix(keys[:64])  # racing the writers: never an error
            assert answer is None or 0 <= answer <= 64
            if reader.retired:
                reader = mapped(plane, namespace)
        for thread in threads:
            thread.join()
        assert not failures, failures
        held = assert_agrees(store, plane, namespace, keys)
        assert held > 0
        generations.add(plane.index_for(namespace)[1])
        assert store.check(verify_bytes=False) == []
    assert store.stats().tier("host").evictions > 0 and store.stats().tier("disk").evictions > 0
    assert max(generations) > 1  # the index filled and was rebuilt at least once
    plane.close()


def test_keys_the_index_refuses_read_absent_and_stay_counted_through_a_rebuild(
        make_store, namespace) -> None:
    """Pages whose keys share both home groups of the first index (16 groups): six groups'
    worth are published, the rest refused (a miss for clients, never a wrong hit), and the
    count outlives the rebuild that more pages bring (refused keys are not offered again)."""
    store = make_store(host_pages=256, disk_pages=16)
    plane = LookupPlane(store)
    colliding = [homed_key(i, 0, 8, 16) for i in range(64)]
    pages = random_pages(8, seed=5)
    for first in range(0, len(colliding), 8):
        store.store(namespace, colliding[first:first + 8], pages)
    index = mapped(plane, namespace)
    found = [key for key in colliding if index.longest_prefix([key]) == 1]
    assert len(found) == 48 and found == colliding[:48]
    assert plane.num_refused(namespace) == 16
    assert plane.total_refused() == 16  # what the daemon's stats show
    assert store.lookup(namespace, colliding).num_prefix == 64  # the store holds them all
    generation = index.generation
    others = random_keys(96, seed=6)
    for first in range(0, len(others), 8):
        store.store(namespace, others[first:first + 8], pages)
    assert plane.index_for(namespace)[1] > generation  # rebuilt
    assert store.lookup(namespace, others).num_prefix == len(others)
    refused = plane.num_refused(namespace)
    assert refused >= 16
    index.close()
    index = mapped(plane, namespace)
    found = [index.longest_prefix([key]) == 1 for key in colliding + others]
    # (the rebuilt index refuses some of the 48 again: their mixed words share their high
    # bits, which pick the groups in a table of any size)
    assert sum(found) == len(colliding) + len(others) - refused
    index.close()
    plane.close()


class HeldBuilds:
    """`build_segment` off the lock held until `release` is set (the test stores while one
    builds), then failing with `fail`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        real = lookup_plane.build_segment

        def held(*args):
            if not threading.current_thread().name.startswith("kvtier-index-build"):
                return real(*args)  # a small index's rebuild, under the lock
            self.started.set()
            assert self.release.wait(timeout=60), "the test never released the build"
            if fail:
                raise OSError("no memory for the new index")
            return real(*args)

        monkeypatch.setattr(lookup_plane, "build_segment", held)


def store_until_a_rebuild_starts(store: PageStore, plane: LookupPlane, namespace: Namespace,
                                 keys: list[bytes], pages: np.ndarray) -> int:
    """Store `keys` 8 at a time until the plane starts a rebuild off the lock; keys stored."""
    for first in range(0, len(keys), 8):
        store.store(namespace, keys[first:first + 8], pages)
        if plane._rebuilds:
            return first + 8
    raise AssertionError("no rebuild started")


def test_a_large_index_is_rebuilt_off_the_lock_with_what_changed_meanwhile(
        make_store, namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild started from a snapshot of a nearly full index: the stores and deletes made
    while it builds (the store's lock is free) reach the new index before it is handed out."""
    builds = HeldBuilds(monkeypatch)
    store = make_store(host_pages=1024, disk_enabled=False)
    plane = LookupPlane(store, background_keys=200)
    keys = random_keys(1000, seed=21)
    pages = random_pages(8, seed=22)
    stored = store_until_a_rebuild_starts(store, plane, namespace, keys, pages)
    assert builds.started.wait(timeout=30)
    generation = plane.index_for(namespace)[1]
    # Meanwhile: keys stored past the old index's usual limit (it stretches rather than wait
    # for its successor), some of them deleted again, keys of the snapshot deleted.
    writer = plane._segments[namespace.fingerprint].writer
    later: list[bytes] = []
    while writer.fill() <= MAX_LOAD:
        batch = keys[stored + len(later):stored + len(later) + 8]
        store.store(namespace, batch, pages)
        later += batch
    store.delete(namespace, later[:2] + keys[:6])
    assert plane.index_for(namespace)[1] == generation  # still the old index, kept current
    assert_agrees(store, plane, namespace, keys)
    builds.release.set()
    harness.wait_until(lambda: plane.index_for(namespace)[1] > generation, "the new index")
    assert assert_agrees(store, plane, namespace, keys) == stored + len(later) - 8
    plane.close()


def test_a_failed_background_rebuild_is_done_again_under_the_lock(
        make_store, namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = HeldBuilds(monkeypatch, fail=True)
    store = make_store(host_pages=1024, disk_enabled=False)
    plane = LookupPlane(store, background_keys=200)
    keys = random_keys(1000, seed=24)
    stored = store_until_a_rebuild_starts(store, plane, namespace, keys, random_pages(8, seed=25))
    generation = plane.index_for(namespace)[1]
    builds.release.set()
    harness.wait_until(lambda: plane.index_for(namespace)[1] > generation, "a new index")
    assert assert_agrees(store, plane, namespace, keys) == stored
    plane.close()


def test_a_page_evicted_and_stored_again_stays_in_the_index(make_store, namespace) -> None:
    """Unpublishing is queued and written in batches; a key evicted and then stored again before
    the queue is written must stay published (the queue is written before the store's)."""
    store = make_store(host_pages=4, disk_enabled=False)
    plane = LookupPlane(store)
    first, second = random_keys(4, seed=11), random_keys(4, seed=12)
    store.store(namespace, first, random_pages(4, seed=13))

    def evict_and_store_again() -> None:  # under the store's lock: no beat in between
        store.store(namespace, second, random_pages(4, seed=14))  # evicts all of `first`
        store.store(namespace, first[:1], random_pages(1, seed=15))

    store.call_locked(evict_and_store_again)
    assert assert_agrees(store, plane, namespace, first + second) == 4
    index = mapped(plane, namespace)
    assert index.longest_prefix(first[:1]) == 1
    index.close()
    plane.close()


def test_a_page_reported_gone_leaves_the_index_by_the_next_beat(make_store, namespace) -> None:
    """With no publish or delete after it, the beat writes the queue of pages gone."""
    store = make_store(host_pages=4, disk_enabled=False)
    plane = LookupPlane(store)
    keys = random_keys(4, seed=16)
    store.store(namespace, keys, random_pages(4, seed=17))
    index = mapped(plane, namespace)
    assert index.longest_prefix(keys) == 4
    store.call_locked(lambda: plane.page_gone(PageEntry(namespace.fingerprint + keys[0],
                                                        namespace)))
    harness.wait_until(lambda: index.longest_prefix(keys[:1]) == 0, "the beat unpublishes")
    assert index.longest_prefix(keys[1:]) == 3
    index.close()
    plane.close()


def test_the_index_holds_what_a_restarted_store_recovered(make_store, namespace,
                                                          tmp_path: Path) -> None:
    keys = random_keys(40, seed=5)
    store = make_store(host_pages=8, disk_pages=64, disk_path=tmp_path / "disk")
    store.store(namespace, keys, random_pages(40, seed=6))
    store.close()
    reopened = make_store(host_pages=8, disk_pages=64, disk_path=tmp_path / "disk")
    plane = LookupPlane(reopened)
    assert assert_agrees(reopened, plane, namespace, keys) > 0
    plane.close()


def test_a_client_cannot_write_its_mapping_and_a_restart_republishes(
        make_daemon, make_pool, socket_dir: Path, tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    layout = harness.make_layout("page-first", 16)
    namespace = harness.namespace_for(layout, "lookup-plane")
    keys = harness.random_keys(np.random.default_rng(7), 16)
    with daemon.client("engine") as engine, daemon.client("scheduler") as scheduler:
        pool = make_pool(layout)
        handle = pool.register(engine, namespace)
        harness.fill_random(pool, np.random.default_rng(8), range(16))
        assert engine.store(handle, keys[:12], list(range(12))).result().ok
        names = scheduler.open_namespace(namespace)
        index = scheduler._indexes[names.pool_id]
        assert scheduler.lookup(names, keys).num_prefix == 12
        engine.delete(handle, keys[6:7])
        assert scheduler.lookup(names, keys).num_prefix == 6
        assert scheduler.lookup(names, keys).tiers[:6] == ["host"] * 6  # asked of the daemon

        mapping = index._mapping
        with pytest.raises(TypeError):
            mapping[0] = 0
        reply = scheduler._call(m.LookupIndex(10**6, names.pool_id))
        assert isinstance(reply, m.LookupIndexReply)
        # Opened for writing, the inode's seals still refuse every write through it.
        writable = os.open(f"/proc/{daemon.pid}/fd/{reply.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.write(writable, b"x")
            with pytest.raises(PermissionError):
                mmap.mmap(writable, reply.size_bytes)
        finally:
            os.close(writable)
        # A store through the mapping's own address faults: it is mapped PROT_READ.
        scribbler = subprocess.run(
            [sys.executable, "-c", SCRIBBLER, str(daemon.socket_path),
             json.dumps(harness.namespace_spec(namespace))], capture_output=True, text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert scribbler.returncode == -11, scribbler.stdout + scribbler.stderr
        assert scheduler.lookup(names, keys).num_prefix == 6  # the daemon is unharmed
        harness.assert_sound(engine)
        engine.unregister_pool(handle)

    daemon.stop_and_check()
    assert index.retired  # a stopped daemon retires its indexes: lookups go to the socket
    restarted = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    with restarted.client("scheduler") as scheduler:
        names = scheduler.open_namespace(namespace)
        assert names.pool_id in scheduler._indexes
        found = scheduler.lookup(names, keys)  # the pages the restart recovered from disk
        assert found.num_prefix == 6
        assert found.tiers == ["disk"] * 6 + [None] + ["disk"] * 5 + [None] * 4


# Maps the index as any client does, then writes through the mapping's address.
SCRIBBLER = r"""
import ctypes, json, sys
import numpy as np
from kvtier.client import Client
from kvtier.keys import Namespace
client = Client(sys.argv[1], "scribbler")
names = client.open_namespace(Namespace(**json.loads(sys.argv[2])))
start = np.frombuffer(client._indexes[names.pool_id]._mapping, np.uint8).ctypes.data
ctypes.memset(start + 64, 0x41, 16)
print("wrote: the mapping is writable", flush=True)
"""


def test_the_index_of_a_killed_daemon_stops_answering(make_daemon, make_pool, socket_dir: Path,
                                                      tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    layout = harness.make_layout("page-first", 4)
    namespace = harness.namespace_for(layout, "lookup-plane-killed")
    keys = harness.random_keys(np.random.default_rng(9), 4)
    with daemon.client("engine") as engine, daemon.client("scheduler") as scheduler:
        pool = make_pool(layout)
        handle = pool.register(engine, namespace)
        assert engine.store(handle, keys, list(range(4))).result().ok
        names = scheduler.open_namespace(namespace)
        index = scheduler._indexes[names.pool_id]
        assert index.longest_prefix(keys) == 4
        daemon.kill()  # no retirement: only its beats stop
        harness.wait_until(lambda: index.longest_prefix(keys) is None,
                           "the killed daemon's index stops answering")
        assert not index.retired
        with pytest.raises(ConnectionError):
            scheduler.lookup(names, keys)  # the socket tells the caller
