"""Sealed memfd pools against a real `kvtier serve`: what the daemon maps can never shrink.

A pool is a memfd sealed against shrinking, growing and unsealing, passed over the socket with
its register_pool frame. Its own client cannot truncate it (EPERM) while the daemon serves it; a
descriptor without those seals (an unsealed memfd, a file on disk, a host arena's segment) is
refused by name; descriptors a client sends without a registration are not kept.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvtier.client import Client, DaemonReplyError, SharedPool
from kvtier.ipc import messages as m
from kvtier.ipc.frames import pack_frame, send_frame_with_fd
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


@pytest.mark.parametrize("kind", ["page-first", "layer-first"])
def test_a_client_cannot_truncate_its_sealed_pool_and_the_daemon_keeps_serving(
        daemon, make_pool, victim, kind: str) -> None:
    layout = harness.make_layout(kind, NUM_PAGES)
    pool = make_pool(layout)
    rng = np.random.default_rng()
    with daemon.client("truncater") as client:
        handle = pool.register(client, harness.namespace_for(layout, "truncater", kind))
        harness.fill_random(pool, rng, range(8))
        keys = harness.random_keys(rng, 8)
        pages = harness.snapshot(pool, range(8))
        assert client.store(handle, keys[:4], range(4)).result().ok
        for size in (0, 4096, layout.span_bytes - 1, layout.span_bytes + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(pool.fd, size)
            with pytest.raises(PermissionError):
                os.truncate(f"/proc/self/fd/{pool.fd}", size)
        with pytest.raises(PermissionError):  # nor can the seals be lifted or changed
            fcntl.fcntl(pool.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(pool.fd).st_size == layout.span_bytes
        assert client.store(handle, keys[4:], range(4, 8)).result().ok
        recalled = client.recall(handle, keys, range(8, 16)).result()
        assert recalled.ok, recalled
        assert np.array_equal(harness.snapshot(pool, range(8, 16)), pages)
        harness.assert_sound(client)


def _memfd(size_bytes: int, seals: int) -> int:
    fd = os.memfd_create("kvtier-pool-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size_bytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize("seals", [0, fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW,
                                   fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL], ids=hex)
def test_a_pool_without_all_three_seals_is_refused_by_name(daemon, victim, seals: int) -> None:
    client, _, pool, _ = victim
    fd = _memfd(pool.layout.span_bytes, seals)
    try:
        with pytest.raises(DaemonReplyError, match="my-pool is not sealed") as refused:
            client.register_sealed_pool(harness.namespace_for(pool.layout, "victim-model"), fd,
                                        pool.layout, "my-pool")
        assert refused.value.code == "bad_request"
    finally:
        os.close(fd)


def test_a_file_on_disk_or_a_host_arena_is_refused_as_a_sealed_pool(
        daemon, victim, tmp_path: Path) -> None:
    """Neither can be sealed: a client could shrink either under the daemon's mapping."""
    client, _, pool, _ = victim
    namespace = harness.namespace_for(pool.layout, "victim-model")
    disk_file = tmp_path / "pool"
    disk_file.write_bytes(bytes(pool.layout.span_bytes))
    for path in (disk_file, Path("/dev/shm", client.arena_segment)):
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(DaemonReplyError, match="not sealed"):
                client.register_sealed_pool(namespace, fd, pool.layout, path.name)
        finally:
            os.close(fd)


def test_a_read_only_or_too_small_sealed_pool_is_refused(daemon, victim) -> None:
    client, _, pool, _ = victim
    namespace = harness.namespace_for(pool.layout, "victim-model")
    read_only = os.open(f"/proc/self/fd/{pool.fd}", os.O_RDONLY)
    small = SharedPool(harness.make_layout("page-first", 2))
    try:
        with pytest.raises(DaemonReplyError, match="not open read-write"):
            client.register_sealed_pool(namespace, read_only, pool.layout, "ro")
        with pytest.raises(DaemonReplyError) as refused:
            client.register_sealed_pool(namespace, small.fd, pool.layout, "small")
        assert refused.value.code == "bad_request"
    finally:
        os.close(read_only)
        small.close()


def test_descriptors_sent_without_a_registration_are_not_kept(daemon, victim) -> None:
    client, _, pool, _ = victim
    baseline_fds = daemon.num_open_fds()
    conn = harness.RawConnection(daemon.socket_path)
    register = {"verb": "register_pool", "descriptor": True, "segment": "raw",
                "namespace": harness.namespace_spec(harness.namespace_for(pool.layout,
                                                                          "victim-model")),
                "layout": harness.layout_spec(pool.layout)}
    try:
        assert isinstance(conn.call(verb="ping", id=1), m.Pong)
        for request_id in range(2, 102):  # each with a descriptor of the pool, on a ping
            send_frame_with_fd(conn.sock, pack_frame(msgspec.msgpack.encode(
                {"verb": "ping", "id": request_id})), pool.fd)
            assert isinstance(conn.reply(), m.Pong)
        # A register_pool without its descriptor: asked to resend (the daemon now reads with
        # recvmsg), then refused; descriptors on pings meanwhile are kept one at most.
        reply = conn.call(id=200, **register)
        assert isinstance(reply, m.Error) and reply.code == m.RESEND_DESCRIPTOR, reply
        for request_id in range(201, 301):
            send_frame_with_fd(conn.sock, pack_frame(msgspec.msgpack.encode(
                {"verb": "ping", "id": request_id})), pool.fd)
            assert isinstance(conn.reply(), m.Pong)
        # The connection's socket and its recvmsg dup, and one descriptor waiting.
        assert daemon.num_open_fds() <= baseline_fds + 3
        reply = conn.call(id=301, **register)
        assert isinstance(reply, m.PoolReply), reply  # the last one sent on a ping
        reply = conn.call(id=302, **register)
        assert isinstance(reply, m.Error) and reply.code == m.RESEND_DESCRIPTOR, reply
        reply = conn.call(id=303, **register)
        assert isinstance(reply, m.Error) and "none arrived" in reply.message, reply
        for request_id, expected in ((304, m.Error), (305, m.PoolReply)):  # as a client resends
            send_frame_with_fd(conn.sock, pack_frame(msgspec.msgpack.encode(
                {**register, "id": request_id})), pool.fd)
            assert isinstance(conn.reply(), expected)
    finally:
        conn.close()
    harness.wait_until(lambda: daemon.num_open_fds() <= baseline_fds,
                       "the raw connection's descriptors to be closed")
