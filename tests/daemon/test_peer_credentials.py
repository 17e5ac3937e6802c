"""Only the daemon's own user reaches it: the socket's mode first, SO_PEERCRED behind it.

A client runs as user `nobody` (uid 65534) in a child process started with `subprocess`'s
`user=`, so these tests need root. The child uses the standard library only (a socket), since
it may not be able to read our virtual environment; it prints what it saw for us to decode.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.client import Client, UntrustedServerError
from kvtier.ipc import messages as m
from kvtier.ipc.frames import LENGTH_PREFIX_BYTES
from kvtier.testing import daemon as harness

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="switching to another user (uid 65534) needs root")

UNPRIVILEGED_CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(30)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print("refused", exc.errno)
    raise SystemExit
received = b""
while chunk := sock.recv(65536):
    received += chunk
print("closed", received.hex())
"""


def run_as_nobody(python: str, socket_path: Path) -> list[str]:
    done = subprocess.run([python, "-I", "-S", "-c", UNPRIVILEGED_CLIENT, str(socket_path)],
                          user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.fixture(scope="module")
def nobody_python() -> str:
    """A Python interpreter user nobody may run (ours may sit in a private home directory)."""
    for candidate in dict.fromkeys([sys.executable, sys._base_executable, "/usr/bin/python3",
                                    "/usr/local/bin/python3"]):
        try:
            done = subprocess.run([candidate, "-I", "-S", "-c", "pass"], user=NOBODY,
                                  group=NOBODY, extra_groups=[], cwd="/", capture_output=True,
                                  timeout=60)
        except OSError:
            continue
        if done.returncode == 0:
            return candidate
    pytest.skip("no Python interpreter that user nobody may run")


@pytest.fixture
def public_socket_dir(socket_dir: Path) -> Path:
    """A socket directory anyone may enter, so only the socket's own mode stands in the way."""
    socket_dir.chmod(0o755)
    return socket_dir


def test_socket_mode_keeps_other_users_out(make_daemon, public_socket_dir: Path, tmp_path: Path,
                                           nobody_python: str) -> None:
    daemon = make_daemon(public_socket_dir / "k.sock", tmp_path / "disk")

    assert run_as_nobody(nobody_python, daemon.socket_path) == ["refused", "13"]  # EACCES

    with daemon.client("owner") as client:
        assert [c["name"] for c in client.stats()["clients"]] == ["owner"]


def test_peer_uid_check_refuses_another_user_even_through_an_open_socket(
        make_daemon, public_socket_dir: Path, tmp_path: Path, nobody_python: str) -> None:
    daemon = make_daemon(public_socket_dir / "k.sock", tmp_path / "disk")
    with daemon.client("owner") as client:
        daemon.socket_path.chmod(0o666)  # as if someone loosened it: SO_PEERCRED still guards

        outcome, received_hex = run_as_nobody(nobody_python, daemon.socket_path)

        assert outcome == "closed"  # the daemon hung up on it
        received = bytes.fromhex(received_hex)
        length = int.from_bytes(received[:LENGTH_PREFIX_BYTES], "big")
        # one reply, then the end of the stream
        assert len(received) == LENGTH_PREFIX_BYTES + length
        reply = m.reply_decoder.decode(received[LENGTH_PREFIX_BYTES:])
        assert isinstance(reply, m.Error)
        assert reply.code == "permission_denied"
        assert f"uid {NOBODY}" in reply.message
        daemon.assert_logged(f"refused a connection from uid {NOBODY}")
        assert [c["name"] for c in client.stats()["clients"]] == ["owner"]
        assert client.check() == []


HELLO_CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(30)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print("refused", exc.errno)
    raise SystemExit
sock.sendall(bytes.fromhex(sys.argv[2]))
received = sock.recv(65536)
print("answered", received.hex())
"""


def hello_as_nobody(python: str, socket_path: Path) -> list[str]:
    hello = m.encoder.encode(m.Hello(1, m.PROTOCOL_VERSION, "nobody"))
    frame = len(hello).to_bytes(LENGTH_PREFIX_BYTES, "big") + hello
    done = subprocess.run([python, "-I", "-S", "-c", HELLO_CLIENT, str(socket_path), frame.hex()],
                          user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def decode_reply(received_hex: str) -> m._Reply:
    received = bytes.fromhex(received_hex)
    return m.reply_decoder.decode(received[LENGTH_PREFIX_BYTES:])


def test_an_allowed_uid_can_reach_the_socket(make_daemon, public_socket_dir: Path,
                                             tmp_path: Path, nobody_python: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`daemon.allowed_uids` used to be dead: the socket stayed 0600 in a 0700 directory."""
    monkeypatch.setenv("KVTIER_DAEMON_ALLOWED_UIDS", str(NOBODY))
    daemon = make_daemon(public_socket_dir / "run" / "k.sock", tmp_path / "disk")

    outcome, received_hex = hello_as_nobody(nobody_python, daemon.socket_path)

    assert outcome == "answered"
    assert isinstance(decode_reply(received_hex), m.HelloReply)
    assert stat.S_IMODE(daemon.socket_path.stat().st_mode) == 0o666
    assert stat.S_IMODE(daemon.socket_path.parent.stat().st_mode) == 0o711


def test_a_socket_group_opens_the_socket_to_that_group_only(
        make_daemon, public_socket_dir: Path, tmp_path: Path, nobody_python: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_DAEMON_ALLOWED_UIDS", str(NOBODY))
    monkeypatch.setenv("KVTIER_DAEMON_SOCKET_GROUP", str(NOBODY))
    daemon = make_daemon(public_socket_dir / "run" / "k.sock", tmp_path / "disk")

    outcome, received_hex = hello_as_nobody(nobody_python, daemon.socket_path)

    assert outcome == "answered"
    assert isinstance(decode_reply(received_hex), m.HelloReply)
    socket_stat, directory_stat = daemon.socket_path.stat(), daemon.socket_path.parent.stat()
    assert (stat.S_IMODE(socket_stat.st_mode), socket_stat.st_gid) == (0o660, NOBODY)
    assert (stat.S_IMODE(directory_stat.st_mode), directory_stat.st_gid) == (0o710, NOBODY)


FAKE_SERVER = """
import os, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind(sys.argv[1])
sock.listen(4)
print("ready", flush=True)
while True:
    connection, _ = sock.accept()
    try:
        if connection.recv(65536):
            connection.sendall(bytes.fromhex(sys.argv[2]))
    except OSError:
        pass
"""


def test_the_client_refuses_a_server_of_another_uid(public_socket_dir: Path,
                                                    nobody_python: str) -> None:
    """Another user who got to the socket path first serves a fake daemon there: a client that
    registered a pool with it would hand it the pool's pages."""
    directory = public_socket_dir / "taken"
    directory.mkdir()
    os.chown(directory, NOBODY, NOBODY)
    path = directory / "kvtier.sock"
    hello = m.encoder.encode(m.HelloReply(1, m.PROTOCOL_VERSION, "fake", "kvtier-host-0-0", 1))
    fake = subprocess.Popen([nobody_python, "-I", "-S", "-c", FAKE_SERVER, str(path),
                             (len(hello).to_bytes(LENGTH_PREFIX_BYTES, "big") + hello).hex()],
                            user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                            stdout=subprocess.PIPE, text=True)
    try:
        assert harness.readline_within(fake.stdout, 30).strip() == "ready"

        with pytest.raises(UntrustedServerError, match=f"runs as uid {NOBODY}"):
            Client(path)

        with Client(path, trusted_server_uids=[NOBODY]) as client:  # told to trust it
            assert client.arena_segment == "kvtier-host-0-0"
    finally:
        fake.kill()
        fake.wait()
        fake.stdout.close()
