"""What a buggy or hostile client can do with its pool, against a real `kvtier serve` (issue #19).

A client that shrinks its pool segment, registers a link to the host arena or swaps the name
between a file and a link fails only its own request; the daemon keeps serving, its neighbours'
pages stay whole, and the integrity walk finds nothing wrong. Also kept here: what already held
(layouts bigger than their segment, page ids out of range, names like `..` and the arena's own).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import Client, DaemonReplyError, SegmentPool, SharedPool
from kvtier.testing import daemon as harness

NUM_PAGES = 16


@pytest.fixture
def victim(daemon, make_pool) -> Iterator[tuple[Client, object, SharedPool, list[bytes]]]:
    """A well-behaved client with 8 pages stored, checked whole at the end of each test."""
    rng = np.random.default_rng()
    layout = harness.make_layout("page-first", NUM_PAGES)
    pool = make_pool(layout)
    with daemon.client("victim") as client:
        handle = pool.register(client, harness.namespace_for(layout, "victim-model"))
        harness.fill_random(pool, rng, range(8))
        keys = harness.random_keys(rng, 8)
        pages = harness.snapshot(pool, range(8))
        assert client.store(handle, keys, range(8)).result().ok
        yield client, handle, pool, keys
        assert daemon.running, daemon.log()
        recalled = client.recall(handle, keys, range(8, 16)).result()
        assert recalled.ok, recalled
        assert np.array_equal(harness.snapshot(pool, range(8, 16)), pages)
        harness.assert_sound(client)


def _shrinking_client(daemon, make_pool) -> tuple[Client, object, SegmentPool, list[bytes]]:
    """A client whose pool is a named segment: a sealed memfd cannot shrink (tested below)."""
    layout = harness.make_layout("layer-first", NUM_PAGES)
    pool = make_pool(layout, named=True)
    client = daemon.client("shrinker")
    handle = pool.register(client, harness.namespace_for(layout, "shrinker-model", "layer-first"))
    harness.fill_random(pool, np.random.default_rng(), range(NUM_PAGES))
    return client, handle, pool, harness.random_keys(np.random.default_rng(), NUM_PAGES)


@pytest.mark.parametrize("size", [0, 4096, 3 * harness.PAGE_BYTES])
def test_a_pool_shrunk_after_registration_fails_its_own_jobs_only(
        daemon, make_pool, victim, size: int) -> None:
    client, handle, pool, keys = _shrinking_client(daemon, make_pool)
    with client:
        stored_before = keys[:4]
        assert client.store(handle, stored_before, range(4)).result().ok
        os.truncate(f"/dev/shm/{pool.segment.name}", size)

        stored = client.store(handle, keys[4:], range(4, NUM_PAGES)).result()
        assert set(stored.failed) == set(keys[4:])
        assert all("shrank" in reason and pool.segment.name in reason
                   for reason in stored.failed.values()), stored.failed
        recalled = client.recall(handle, stored_before, range(4)).result()
        assert set(recalled.failed) == set(stored_before)
        assert "shrank" in next(iter(recalled.failed.values()))
        assert os.stat(f"/dev/shm/{pool.segment.name}").st_size == size  # not grown back
        assert client.lookup(handle, keys[4:]).tiers == [None] * (NUM_PAGES - 4)


def test_a_pool_truncated_and_regrown_during_copies_never_kills_the_daemon(
        daemon, make_pool, victim) -> None:
    """The file changes size while copies run: every job either moves or fails, named."""
    client, handle, pool, _ = _shrinking_client(daemon, make_pool)
    path = f"/dev/shm/{pool.segment.name}"
    full_bytes = pool.layout.span_bytes
    stop = threading.Event()

    def flap() -> None:
        while not stop.is_set():
            os.truncate(path, 0)
            os.truncate(path, full_bytes)

    flapper = threading.Thread(target=flap)
    flapper.start()
    try:
        with client:
            rng = np.random.default_rng()
            for _ in range(30):
                keys = harness.random_keys(rng, NUM_PAGES)
                stored = client.store(handle, keys, range(NUM_PAGES)).result()
                done = [key for key in keys if key not in stored.failed]
                recalled = client.recall(handle, done, range(len(done))).result()
                assert all("shrank" in why for why in {**stored.failed, **recalled.failed}.values())
    finally:
        stop.set()
        flapper.join()


def test_a_link_to_the_host_arena_is_refused_as_a_pool(daemon, victim, tmp_path: Path) -> None:
    client, _, pool, _ = victim
    arena = client.arena_segment
    link = Path("/dev/shm", f"kvtier-pool-{os.getpid()}-link{os.urandom(4).hex()}")
    link.symlink_to(Path("/dev/shm", arena))
    try:
        with pytest.raises(DaemonReplyError, match="symbolic link"):
            client.register_pool(harness.namespace_for(pool.layout, "victim-model"), link.name,
                                 pool.layout)
    finally:
        link.unlink()


def test_a_hard_link_to_the_host_arena_is_refused_as_a_pool(daemon, victim) -> None:
    client, _, pool, _ = victim
    link = Path("/dev/shm", f"kvtier-pool-{os.getpid()}-hard{os.urandom(4).hex()}")
    try:
        os.link(Path("/dev/shm", client.arena_segment), link)
    except OSError as exc:  # fs.protected_hardlinks or a read-only /dev/shm
        pytest.skip(f"cannot hard-link the arena here: {exc}")
    try:
        with pytest.raises(DaemonReplyError, match="daemon's own memory"):
            client.register_pool(harness.namespace_for(pool.layout, "victim-model"), link.name,
                                 pool.layout)
    finally:
        link.unlink()


def test_a_name_swapped_between_a_file_and_a_link_never_reads_the_link_target(
        daemon, make_pool, victim, tmp_path: Path) -> None:
    """The name flips between the client's own pool and a link to a secret file; every
    registration is refused or gets the pool, and no store ever holds the secret's bytes."""
    client, _, _, _ = victim
    layout = harness.make_layout("page-first", 2)
    pool = make_pool(layout, named=True)
    harness.fill_random(pool, np.random.default_rng(), range(2))
    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * layout.span_bytes)
    name = f"kvtier-pool-{os.getpid()}-swap{os.urandom(4).hex()}"
    path, as_file, as_link = (Path("/dev/shm", name), Path("/dev/shm", name + ".f"),
                              Path("/dev/shm", name + ".l"))
    os.link(Path("/dev/shm", pool.segment.name), as_file)
    as_link.symlink_to(secret)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for source in (as_file, as_link):
                tmp = path.with_name(name + ".t")
                os.link(source, tmp, follow_symlinks=False)
                os.replace(tmp, path)

    swapper = threading.Thread(target=swap)
    swapper.start()
    namespace = harness.namespace_for(layout, "swap-model")
    try:
        for _ in range(40):
            try:
                handle = client.register_pool(namespace, name, layout)
            except DaemonReplyError as exc:
                assert "symbolic link" in str(exc) or "cannot open" in str(exc), exc
                continue
            key = os.urandom(16)
            assert client.store(handle, [key], [0]).result().ok
            out = make_pool(layout)
            out_handle = out.register(client, namespace)
            assert client.recall(out_handle, [key], [0]).result().ok
            assert not np.all(out.pages[0] == ord("S")), "the daemon read the link's target"
            assert np.array_equal(out.pages[0], pool.pages[0])
            client.unregister_pool(out_handle)
            client.unregister_pool(handle)
    finally:
        stop.set()
        swapper.join()
        for leftover in (path, as_file, as_link, path.with_name(name + ".t")):
            leftover.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666], ids=oct)
def test_a_pool_other_users_can_write_is_refused(daemon, make_pool, victim, mode: int) -> None:
    """Another user could change its pages between our store's copy and its checksum."""
    client, _, _, _ = victim
    layout = harness.make_layout("page-first", 2)
    pool = make_pool(layout, named=True)
    os.chmod(f"/dev/shm/{pool.segment.name}", mode)
    with pytest.raises(DaemonReplyError, match="writable by other users"):
        pool.register(client, harness.namespace_for(layout, "victim-model"))


@pytest.mark.parametrize("name", ["..", ".", "../x", "x/../..", "ARENA"])
def test_names_outside_dev_shm_or_the_arena_are_refused(daemon, victim, name: str) -> None:
    client, _, pool, _ = victim
    name = client.arena_segment if name == "ARENA" else name
    with pytest.raises(DaemonReplyError) as refused:
        client.register_pool(harness.namespace_for(pool.layout, "victim-model"), name,
                             pool.layout)
    assert refused.value.code == "bad_request", refused.value


def test_a_fifo_planted_as_a_pool_is_refused_without_blocking(daemon, victim) -> None:
    client, _, pool, _ = victim
    fifo = Path("/dev/shm", f"kvtier-pool-{os.getpid()}-fifo{os.urandom(4).hex()}")
    os.mkfifo(fifo, 0o600)
    try:
        with pytest.raises(DaemonReplyError, match="not a shared-memory file"):
            client.register_pool(harness.namespace_for(pool.layout, "victim-model"), fifo.name,
                                 pool.layout)
    finally:
        fifo.unlink()


def test_another_daemons_arena_is_refused_as_a_pool(daemon, make_daemon, socket_dir: Path,
                                                     tmp_path: Path, victim) -> None:
    """Recalls into it would change pages the other daemon serves its own clients."""
    client, _, pool, _ = victim
    other = make_daemon(socket_dir / "other.sock", tmp_path / "other-disk")
    with other.client() as other_client:
        other_arena = other_client.arena_segment
    with pytest.raises(DaemonReplyError, match="host arena, not a pool"):
        client.register_pool(harness.namespace_for(pool.layout, "victim-model"), other_arena,
                             pool.layout)
    other.stop_and_check()
