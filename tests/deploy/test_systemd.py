"""The systemd side: the unit in deploy/ passes `systemd-analyze verify`, and the daemon tells
systemd it is ready (READY=1 over $NOTIFY_SOCKET) and that it stops (STOPPING=1).

The notify tests listen on a datagram socket of their own, as systemd does.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.daemon.notify import notify, notify_ready

UNIT = Path(__file__).parents[2] / "deploy" / "kvtier.service"
RECEIVE_TIMEOUT_S = 30.0


def verify(unit_text: str, directory: Path) -> list[str]:
    """`systemd-analyze verify` of `unit_text` with ExecStart= pointing at this environment's
    kvtier (verify insists that the binary exists); the problems it reports about the unit."""
    kvtier = shutil.which("kvtier") or str(Path(sys.executable).with_name("kvtier"))
    path = directory / "kvtier.service"
    path.write_text(unit_text.replace("/opt/kvtier/bin/kvtier", kvtier))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)],
                          capture_output=True, text=True, timeout=120)
    # verify exits 0 on many problems it only warns about: read what it says about our file.
    problems = [line for line in (done.stdout + done.stderr).splitlines() if path.name in line]
    if done.returncode != 0:
        problems.append(f"exit code {done.returncode}: {done.stderr.strip()}")
    return problems


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is missing (Debian: apt-get install systemd)")
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = UNIT.read_text()
    assert "Type=notify" in unit and "RuntimeDirectory=kvtier" in unit

    assert verify(unit, tmp_path) == []
    # The check can fail: a misspelt key in a copy is reported.
    assert verify(unit.replace("ProtectHome=yes", "ProtectHom=yes"), tmp_path)


def test_the_unit_runs_the_daemon_with_its_socket_in_the_runtime_directory() -> None:
    settings = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), value.strip())
    assert settings["ExecStart"].split()[1:] == ["serve", "--socket", "/run/kvtier/kvtier.sock"]
    # /dev/shm is shared with the engines: nothing may hide it or remove their segments.
    assert settings["RemoveIPC"] == "no"
    assert "PrivateDevices" not in settings and "PrivateIPC" not in settings


@pytest.fixture
def notify_socket(socket_dir: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket listening where systemd's would, and its path."""
    path = str(socket_dir / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(RECEIVE_TIMEOUT_S)
    yield sock, path
    sock.close()


def test_notify_sends_the_state_as_one_datagram(notify_socket) -> None:
    sock, path = notify_socket
    assert notify("READY=1\nSTATUS=serving", {"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_reaches_an_abstract_socket() -> None:
    name = f"kvtier-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(RECEIVE_TIMEOUT_S)
        assert notify("READY=1", {"NOTIFY_SOCKET": f"@{name}"})
        assert sock.recv(4096) == b"READY=1"


def test_notify_without_systemd_sends_nothing_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify_ready("serving")
    assert not notify("READY=1", {"NOTIFY_SOCKET": "relative/path"})


def test_the_daemon_notifies_ready_once_serving_and_stopping_on_sigterm(
        notify_socket, make_daemon, socket_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")

    ready = sock.recv(4096).decode().split("\n")
    assert "READY=1" in ready and f"MAINPID={daemon.pid}" in ready
    with daemon.client() as client:  # READY=1 came after the socket was served
        assert client.stats()["clients"]
    daemon.stop_and_check()
    assert "STOPPING=1" in sock.recv(4096).decode().split("\n")
