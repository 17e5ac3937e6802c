"""The one daemon-process harness: its command line, a real daemon's start and stop, and the
poll that pauses between tries."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvtier.testing import daemon as harness
from kvtier.testing.daemon_process import DaemonProcess, serve_argv


def test_the_child_runs_isolated_unless_told_otherwise() -> None:
    socket_path = Path("/tmp/k.sock")
    assert serve_argv(socket_path, "--no-disk") == [
        sys.executable, "-I", "-m", "kvtier.cli.main", "serve", "--socket", "/tmp/k.sock",
        "--no-disk"]
    assert "-I" not in serve_argv(socket_path, isolated=False)


def test_a_started_daemon_is_ready_answers_and_stops_cleanly(socket_dir: Path) -> None:
    with DaemonProcess.start(socket_dir / "k.sock", "--no-disk", "--host-capacity", "16MiB",
                             "--no-prefault") as daemon:
        with daemon.client("harness") as client:
            assert client.stats()["tiers"][0]["tier"] == "host"
        assert daemon.stop() == 0
    assert not daemon.running and "kvtier ready" in daemon.log()


def test_poll_until_pauses_between_tries() -> None:
    calls = 0

    def never() -> bool:
        nonlocal calls
        calls += 1
        return False

    started = time.monotonic()
    assert not harness.poll_until(never, timeout_s=0.2, interval_s=0.02)
    assert time.monotonic() - started >= 0.2
    assert calls <= 0.2 / 0.02 + 2  # a tight loop makes thousands of tries


def test_poll_until_returns_once_the_predicate_holds() -> None:
    answers = iter([False, False, True])
    assert harness.poll_until(lambda: next(answers), timeout_s=5.0, interval_s=0.001)
