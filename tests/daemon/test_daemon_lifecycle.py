"""The daemon's life: claiming its socket, refusing a second daemon, SIGTERM while busy, restart.

Each test starts its own daemons (`make_daemon`), since it stops, kills or restarts them.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import Client, DaemonReplyError
from kvtier.testing import daemon as harness


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_socket_is_private_to_its_owner(make_daemon, socket_dir: Path, tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")

    assert stat.S_ISSOCK(os.stat(daemon.socket_path).st_mode)
    assert mode_of(daemon.socket_path) == 0o600
    assert mode_of(daemon.lock_path) == 0o600
    assert daemon.lock_path.read_text() == str(daemon.pid)


def test_missing_socket_directory_is_created_private(make_daemon, socket_dir: Path,
                                                     tmp_path: Path) -> None:
    socket_path = socket_dir / "run" / "kvtier" / "k.sock"

    daemon = make_daemon(socket_path, tmp_path / "disk")

    assert mode_of(socket_path.parent) == 0o700
    daemon.assert_logged(f"created socket directory {socket_path.parent} (mode 0700) and its "
                         f"missing parents {socket_dir / 'run'}")  # said, not silent
    with daemon.client() as client:
        client.ping()
        assert client.check() == []


def test_second_daemon_on_the_same_socket_refuses_and_leaves_the_first_alone(
        make_daemon, socket_dir: Path, tmp_path: Path) -> None:
    first = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    with first.client("first-user") as client:
        client.ping()

        second = make_daemon(socket_dir / "k.sock", tmp_path / "disk2", wait_ready=False)

        assert second.wait_exit() != 0
        assert "another kvtier daemon" in second.log()
        assert f"pid {first.pid}" in second.log() and str(first.socket_path) in second.log()
        assert "Traceback" not in second.log()
        client.ping()  # the connection made before is untouched
        assert first.running and first.socket_path.exists() and first.lock_path.exists()
    with first.client("after") as client:  # and new ones still reach the first daemon
        assert [c["name"] for c in client.stats()["clients"]] == ["after"]
        assert client.check(verify_bytes=True) == []


def test_stale_socket_of_a_killed_daemon_does_not_block_a_new_one(
        make_daemon, socket_dir: Path, tmp_path: Path) -> None:
    crashed = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    crashed.kill()
    assert crashed.socket_path.exists(), "SIGKILL should leave the socket file behind"

    replacement = make_daemon(socket_dir / "k.sock", tmp_path / "disk")

    assert replacement.lock_path.read_text() == str(replacement.pid)
    with replacement.client() as client:
        client.ping()
        assert client.check(verify_bytes=True) == []


@pytest.mark.parametrize("write_policy", [
    "write-through",
    "write-back",
])
def test_sigterm_during_sustained_stores_keeps_every_acknowledged_page(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool, write_policy: str) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--write-policy",
                         write_policy)
    layout = harness.make_layout("page-first", 64)
    namespace = harness.namespace_for(layout, "sigterm")
    pool = make_pool(layout)
    rng = np.random.default_rng(12)
    harness.fill_random(pool, rng, range(64))
    acknowledged: dict[bytes, np.ndarray] = {}  # key -> the bytes the store said it kept
    enough_stored = threading.Event()
    ended_by: list[BaseException] = []

    def store_until_the_daemon_goes(client: Client) -> None:
        handle = pool.register(client, namespace)
        batch_rng = np.random.default_rng(13)
        try:
            while True:
                start = int(batch_rng.integers(0, 48))
                keys = harness.random_keys(batch_rng, 16)
                # Two jobs in flight at once, so the signal lands while the daemon is busy.
                first = client.store(handle, keys[:8], range(start, start + 8))
                second = client.store(handle, keys[8:], range(start + 8, start + 16))
                for job, offset in ((first, 0), (second, 8)):
                    result = job.result()
                    for i, key in enumerate(keys[offset:offset + 8]):
                        if key not in result.failed:
                            acknowledged[key] = pool.pages[start + offset + i].copy()
                if len(acknowledged) >= 256:
                    enough_stored.set()
        except (ConnectionError, DaemonReplyError, OSError) as exc:
            ended_by.append(exc)
        finally:
            enough_stored.set()

    with daemon.client("sustained") as client:
        storer = threading.Thread(target=store_until_the_daemon_goes, args=(client,))
        storer.start()
        assert enough_stored.wait(60)
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0, daemon.log()
        storer.join(60)
        assert not storer.is_alive()
    assert ended_by, "the storing thread should have seen the daemon go"
    assert not daemon.socket_path.exists() and not daemon.lock_path.exists()
    assert len(acknowledged) >= 256

    restarted = make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--write-policy",
                            write_policy)
    keys = list(acknowledged)
    with restarted.client("after-restart") as client:
        handle = pool.register(client, namespace)
        assert client.lookup(handle, keys).num_prefix == len(keys)
        for start in range(0, len(keys), 64):
            batch = keys[start:start + 64]
            result = client.recall(handle, batch, range(len(batch))).result()
            assert result.ok, (result.missing, result.failed)
            for i, key in enumerate(batch):
                np.testing.assert_array_equal(pool.pages[i], acknowledged[key])
        assert client.check() == []
        assert client.check(verify_bytes=True) == []


def test_sigterm_with_clients_connected_logs_no_traceback(make_daemon, socket_dir: Path,
                                                          tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    with daemon.client("idle") as client:
        client.ping()
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0

    assert "Traceback" not in daemon.log() and " ERROR " not in daemon.log(), daemon.log()
