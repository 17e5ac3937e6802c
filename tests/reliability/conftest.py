"""A real daemon for the reliability tests, started with
`kvtier.testing.daemon_process.DaemonProcess`."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.daemon_process import DaemonProcess


@pytest.fixture(scope="module")
def reliability_daemon() -> Iterator[DaemonProcess]:
    """One daemon per test module: 16 MiB host, 64 MiB disk, under a short /tmp directory."""
    work = Path(tempfile.mkdtemp(prefix="kvrel-", dir="/tmp"))  # socket paths must stay short
    daemon = DaemonProcess.start(work / "k.sock", "--host-capacity", "16MiB", "--disk-path",
                                 str(work / "disk"), "--disk-capacity", "64MiB", "--no-prefault")
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log()
    finally:
        if daemon.running:
            daemon.kill()
        shutil.rmtree(work, ignore_errors=True)
