"""Housekeeping removes the pool segments of this daemon's clients that died, says so, and leaves
alone a dead process's segment that was never its client's (another daemon's client, maybe).

In-process, on the housekeeping coroutine itself, with a short interval: a daemon test would wait
a second between rounds, while every other kvtier daemon on the machine may reclaim (all, in old
versions) the dead pids' segments first."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.daemon import process
from kvtier.daemon.server import ControlServer
from kvtier.daemon.service import Service
from kvtier.store.page_store import PageStore


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    return int(child.stdout)


def test_only_a_dead_clients_pool_is_reclaimed(make_store: Callable[..., PageStore],
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    store = make_store(host_pages=4)
    # The server (never started) is what housekeeping asks whether large requests freed memory.
    service = Service(store, copy_threads=1)
    server = ControlServer(service, max_frame_bytes=1 << 20, max_inflight_per_client=4)
    monkeypatch.setattr(process, "HOUSEKEEPING_INTERVAL_S", 0.01)
    caplog.set_level(logging.INFO, logger="kvtier.daemon.process")
    # Another daemon on this machine (an older kvtier reclaims every dead pid's segment) may take
    # the client's segment first: then this round proves nothing, and a fresh one is tried.
    try:
        reclaim_in_rounds(store, server, caplog)
    finally:
        service.close()


def reclaim_in_rounds(store: PageStore, server: ControlServer,
                      caplog: pytest.LogCaptureFixture) -> None:
    for _ in range(5):
        client_pid, stranger_pid = dead_pid(), dead_pid()
        client = Path("/dev/shm", f"kvtier-pool-{client_pid}-{os.urandom(6).hex()}")
        stranger = Path("/dev/shm", f"kvtier-pool-{stranger_pid}-{os.urandom(6).hex()}")
        line = f"removed the pool segment {client.name} of client pid {client_pid}, which died"

        async def one_round() -> None:
            stop = asyncio.Event()
            housekeeping = asyncio.create_task(
                process.Daemon._housekeep_until(store, server, stop, {client_pid}))
            while line not in caplog.text and client.exists() and not housekeeping.done():
                await asyncio.sleep(0.01)  # the coroutine's own pace: it logs, or it ended
            stop.set()
            await housekeeping

        try:
            client.write_bytes(b"x")
            stranger.write_bytes(b"x")
            asyncio.run(asyncio.wait_for(one_round(), 60))
            # Whoever else removed what, this housekeeping never touched the stranger's.
            assert stranger.name not in caplog.text
            if line in caplog.text:
                assert not client.exists()
                return
        finally:
            client.unlink(missing_ok=True)
            stranger.unlink(missing_ok=True)
    raise AssertionError("in 5 tries, housekeeping never reclaimed the dead client's segment")
