"""The socket's directory and lock file cannot be turned against the daemon, and the client
cannot be fed a reply that never ends (issue #19, findings 4 and 11).

Without `$XDG_RUNTIME_DIR` the default socket lives in `<tmp>/kvtier-<uid>/`, a name another
local user can create first. The daemon must refuse a directory it does not own or that others
may write into, must not follow a link planted at its lock file, and must say in one line when a
socket path is too long for a Unix socket.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from kvtier.client import Client
from kvtier.errors import FrameTooLarge
from kvtier.ipc.frames import LENGTH_PREFIX_BYTES

NOBODY = 65534


def assert_refused(daemon, *says: str) -> None:
    assert daemon.wait_exit() != 0, daemon.log()
    log = daemon.log()
    for text in says:
        assert text in log, log
    assert "Traceback" not in log, log


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_socket_directory_made_by_another_user_is_refused(make_daemon, socket_dir: Path,
                                                            tmp_path: Path) -> None:
    planted = socket_dir / "kvtier-0"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)
    planted.chmod(0o777)

    daemon = make_daemon(planted / "kvtier.sock", tmp_path / "disk", wait_ready=False)

    assert_refused(daemon, f"belongs to uid {NOBODY}", str(planted))
    assert not (planted / "kvtier.sock").exists()


@pytest.mark.parametrize("mode, says", [(0o777, "writable by others"),
                                        (0o770, "writable by its group")])
def test_a_socket_directory_others_may_write_is_refused(make_daemon, socket_dir: Path,
                                                        tmp_path: Path, mode: int,
                                                        says: str) -> None:
    shared = socket_dir / "shared"
    shared.mkdir()
    shared.chmod(mode)

    daemon = make_daemon(shared / "k.sock", tmp_path / "disk", wait_ready=False)

    assert_refused(daemon, says, f"mode {mode:04o}")


def test_a_link_planted_at_the_lock_file_is_not_followed(make_daemon, socket_dir: Path,
                                                         tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    (socket_dir / "k.sock.lock").symlink_to(victim)

    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", wait_ready=False)

    assert_refused(daemon, "symbolic link")
    assert victim.read_text() == "precious"  # not truncated, no pid written through the link


def test_a_hard_link_at_the_lock_file_is_not_truncated(make_daemon, socket_dir: Path,
                                                       tmp_path: Path) -> None:
    victim = socket_dir / "victim"
    victim.write_text("precious")
    os.link(victim, socket_dir / "k.sock.lock")

    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", wait_ready=False)

    assert_refused(daemon, "2 links")
    assert victim.read_text() == "precious"


def test_a_socket_path_too_long_for_a_unix_socket_is_one_clear_line(make_daemon, socket_dir: Path,
                                                                     tmp_path: Path) -> None:
    socket_path = socket_dir / ("d" * 60) / ("s" * 60 + ".sock")
    assert len(os.fsencode(str(socket_path))) > 108

    daemon = make_daemon(socket_path, tmp_path / "disk", wait_ready=False)

    assert_refused(daemon, "at most 108", "shorter --socket")
    assert [line for line in daemon.log().splitlines() if line.strip()] == [
        line for line in daemon.log().splitlines() if "Error:" in line]


def test_the_client_refuses_a_reply_frame_over_its_cap(socket_dir: Path) -> None:
    """A server (here a fake of our own uid) announcing a 1 GiB reply: the client must not
    wait for, nor buffer, such a frame."""
    path = socket_dir / "fake.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    hold = threading.Event()

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)  # the hello
            connection.sendall((1 << 30).to_bytes(LENGTH_PREFIX_BYTES, "big") + b"\x00" * 1024)
            hold.wait(60)  # and then nothing: the rest of the "frame" never comes

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with pytest.raises(FrameTooLarge, match="over the"):
            Client(path, timeout_s=20.0)
    finally:
        hold.set()
        server.join(10)
        listener.close()
