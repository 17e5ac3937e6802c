"""What one client may hold is capped, and going past a cap is that client's error reply, never
the daemon's end (issue #19, findings 2, 7 and 10).

Before the fixes: ~1,000 pool registrations or idle connections used the 1024 descriptors and the
housekeeping loop's /dev/shm scan (EMFILE) ended the daemon; half-sent 8 MiB frames on 300
connections took it to 2.5 GiB; a lease could be pinned for `inf` seconds, and one connection
made 185,500 of them.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kvtier.client import DaemonReplyError
from kvtier.daemon.limits import FD_RESERVE, Limits
from kvtier.ipc import messages as m
from kvtier.testing import daemon as harness
from kvtier.testing.daemon_process import serve_argv

# Runs the daemon with its open-file limit set to argv[1] (soft) and argv[2] (hard).
WITH_FD_LIMIT = ("import os, resource, sys; "
                 "resource.setrlimit(resource.RLIMIT_NOFILE, "
                 "(int(sys.argv[1]), int(sys.argv[2]))); "
                 "os.execv(sys.argv[3], sys.argv[3:])")


def start_with_fd_limit(socket_path: Path, disk_path: Path, soft: int,
                        hard: int) -> harness.DaemonProcess:
    serve = serve_argv(socket_path, "--host-capacity", "64MiB", "--disk-path", str(disk_path),
                       "--disk-capacity", "256MiB", "--no-prefault",
                       "--max-clients-per-peer", "4096",  # these tests open every connection
                       isolated=False)
    argv = [sys.executable, "-c", WITH_FD_LIMIT, str(soft), str(hard), *serve]
    daemon = harness.DaemonProcess(socket_path, disk_path, argv)
    daemon.wait_ready(harness.READY_TIMEOUT_S)
    return daemon


def fd_limits_of(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc/<pid>/limits")


def hello(connection: harness.RawConnection) -> m._Reply:
    """The hello's reply, or the refusal the daemon sent as it accepted (and closed)."""
    try:
        connection.send(verb="hello", id=1, version=m.PROTOCOL_VERSION)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at once: its reply is already here
    return connection.reply()


def dead_client_pid(socket_path: Path) -> int:
    """The pid of a process that was a client of the daemon at `socket_path` and has exited:
    housekeeping reclaims segments of its own clients that died, no one else's."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; from kvtier.client import Client; "
                              "Client(sys.argv[1], 'short-lived').close()", str(socket_path)])
    assert child.wait(timeout=120) == 0
    return child.pid


def test_the_open_file_limit_is_raised_to_the_hard_limit(socket_dir: Path,
                                                         tmp_path: Path) -> None:
    daemon = start_with_fd_limit(socket_dir / "k.sock", tmp_path / "disk", 256, 4096)
    try:
        assert fd_limits_of(daemon.pid) == (4096, 4096)
    finally:
        daemon.stop_and_check()


def test_a_client_may_register_only_so_many_pools(daemon, make_pool) -> None:
    layout = harness.make_layout("page-first", 4)
    pool = make_pool(layout)
    namespace = harness.namespace_for(layout, "many-pools")
    max_pools = Limits().max_pools_per_client
    with daemon.client("greedy") as client:
        handles = [pool.register(client, namespace) for _ in range(max_pools)]

        with pytest.raises(DaemonReplyError, match="max_pools_per_client") as refused:
            pool.register(client, namespace)

        assert refused.value.code == "quota"
        client.unregister_pool(handles.pop())
        handles.append(pool.register(client, namespace))  # room again once one is gone
        with daemon.client("neighbour") as neighbour:
            pool.register(neighbour, namespace)  # the cap is per client


def test_descriptor_exhaustion_is_refused_and_housekeeping_goes_on(socket_dir: Path,
                                                                  tmp_path: Path,
                                                                  make_pool) -> None:
    """At a 512-descriptor limit: 600 connections, then pools on top. Each refused one gets a
    clear reply; the daemon keeps serving and its housekeeping keeps running."""
    fd_limit = 512
    daemon = start_with_fd_limit(socket_dir / "k.sock", tmp_path / "disk", fd_limit, fd_limit)
    connections: list[harness.RawConnection] = []
    gone_client_pid = dead_client_pid(daemon.socket_path)  # before the limit leaves no room
    try:
        refusals: list[m.Error] = []
        for _ in range(600):
            connection = harness.RawConnection(daemon.socket_path)
            reply = hello(connection)
            if isinstance(reply, m.Error):
                refusals.append(reply)
                assert connection.closed_by_peer()
                connection.close()
            else:
                connections.append(connection)
        max_clients = min(Limits().max_clients, fd_limit - FD_RESERVE)
        assert len(connections) == max_clients
        assert refusals and {r.code for r in refusals} == {"quota"}
        assert "max_clients" in refusals[0].message or "descriptors" in refusals[0].message

        # Pools on the connections already held: those past the descriptor budget are refused.
        layout = harness.make_layout("page-first", 4)
        pool = make_pool(layout, named=True)
        namespace = harness.namespace_for(layout, "fd-budget")
        register = dict(verb="register_pool", namespace=harness.namespace_spec(namespace),
                        segment=pool.segment.name, layout=harness.layout_spec(layout))
        replies = [connection.call(id=2 + i, **register)
                   for i, connection in enumerate(connections[:8])]
        refused = [r for r in replies if isinstance(r, m.Error)]
        assert refused, replies
        assert all(r.code == "quota" and "descriptors" in r.message for r in refused), refused

        # Housekeeping still runs at the limit: it removes a dead client's orphan segment.
        orphan = Path("/dev/shm", f"kvtier-pool-{gone_client_pid}-{os.urandom(6).hex()}")
        orphan.write_bytes(b"")
        harness.wait_until(lambda: not orphan.exists() and daemon.running,
                           "housekeeping to remove an orphan segment")
        assert daemon.running, daemon.log()
        assert isinstance(connections[0].call(verb="ping", id=99), m.Pong)
    finally:
        for connection in connections:
            connection.close()
    with daemon.client("after") as client:  # descriptors are given back
        harness.wait_until(lambda: len(client.stats()["clients"]) == 1, "connections to close")
        pool.register(client, namespace)
        harness.assert_sound(client)
    assert "housekeeping failed" not in daemon.log()
    daemon.stop_and_check()


def test_a_frame_that_stalls_midway_times_out(make_daemon, socket_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_DAEMON_FRAME_TIMEOUT", "0.5")
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    staller = harness.RawConnection(daemon.socket_path, timeout_s=30.0)
    try:
        assert isinstance(hello(staller), m.HelloReply)
        staller.send_raw((1000).to_bytes(4, "big") + b"\x81" * 10)  # 10 of 1000 bytes, then nothing

        reply = staller.reply()

        assert isinstance(reply, m.Error) and reply.code == "frame_timeout", reply
        assert "daemon.frame_timeout" in reply.message
        assert staller.closed_by_peer()
    finally:
        staller.close()
    with daemon.client() as client:
        client.ping()


def test_unfinished_frames_of_all_clients_are_bounded(make_daemon, socket_dir: Path,
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """24 connections each send half of an 8 MiB frame under an 8 MiB budget: those crossing it
    are cut off, and the daemon's memory stays near the budget (96 MiB more before the fix).
    Those whose half frame fitted stall, and time out."""
    budget_bytes = 8 << 20
    monkeypatch.setenv("KVTIER_DAEMON_MAX_BUFFERED_BYTES", str(budget_bytes))
    monkeypatch.setenv("KVTIER_DAEMON_FRAME_TIMEOUT", "5")
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    process = psutil.Process(daemon.pid)
    rss_before = process.memory_info().rss
    half_frame = ((8 << 20) - 16).to_bytes(4, "big") + b"\x00" * (4 << 20)
    connections = []
    try:
        for _ in range(24):
            connection = harness.RawConnection(daemon.socket_path)
            connections.append(connection)
            assert isinstance(hello(connection), m.HelloReply)
            try:
                connection.send_raw(half_frame)
            except (BrokenPipeError, ConnectionResetError):
                pass  # cut off while sending: its reply was written before
        rss_growth_bytes = process.memory_info().rss - rss_before
        codes = [connection.reply().code for connection in connections]
    finally:
        for connection in connections:
            connection.close()
    assert set(codes) <= {"quota", "frame_timeout"}, codes
    assert codes.count("quota") >= 20, codes
    assert rss_growth_bytes < 3 * budget_bytes + (16 << 20), rss_growth_bytes >> 20
    with daemon.client() as client:
        client.ping()


def test_a_lease_cannot_be_endless(daemon, make_pool) -> None:
    layout = harness.make_layout("page-first", 4)
    pool = make_pool(layout)
    max_lease_s = Limits().max_lease_s
    with daemon.client("leaser") as client:
        handle = pool.register(client, harness.namespace_for(layout, "leases"))
        keys = [b"k" * 16]
        assert client.store(handle, keys, [0]).result().ok
        for ttl_s in (math.inf, math.nan, 1e308, max_lease_s * 2, 0.0, -1.0):
            with pytest.raises(DaemonReplyError, match="daemon.max_lease") as refused:
                client.pin(handle, keys, ttl_s)
            assert refused.value.code == "bad_request"
        lease, missing = client.pin(handle, keys, max_lease_s)  # the longest allowed
        assert missing == []
        client.unpin(lease)


def test_a_client_may_hold_only_so_many_leases(make_daemon, socket_dir: Path, tmp_path: Path,
                                               make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_DAEMON_MAX_LEASES_PER_CLIENT", "8")
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    layout = harness.make_layout("page-first", 4)
    pool = make_pool(layout)
    with daemon.client("leaser") as client:
        handle = pool.register(client, harness.namespace_for(layout, "leases"))
        keys = [b"k" * 16]
        assert client.store(handle, keys, [0]).result().ok
        leases = [client.pin(handle, keys, 60.0)[0] for _ in range(8)]

        with pytest.raises(DaemonReplyError, match="max_leases_per_client") as refused:
            client.pin(handle, keys, 60.0)

        assert refused.value.code == "quota"
        client.unpin(leases.pop())
        leases.append(client.pin(handle, keys, 0.2)[0])  # room again after an unpin

        def expired_lease_makes_room() -> bool:
            try:
                leases.append(client.pin(handle, keys, 60.0)[0])
            except DaemonReplyError:
                return False
            return True

        harness.wait_until(expired_lease_makes_room, "the short lease to expire and free its place")
        assert client.stats()["num_leases"] == 8
        harness.assert_sound(client)
