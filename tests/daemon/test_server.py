"""The control server on its own: it needs only a `RequestHandler`, not the daemon's service.

The handler here is the smallest real one (ping answered on the loop, a job answered on a
thread), so these tests exercise the server's framing, dispatch and session lifetime without a
page store.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvtier.daemon.handler import Deferred, RequestHandler
from kvtier.daemon.server import ControlServer
from kvtier.ipc import messages as m
from kvtier.ipc.frames import pack_frame, recv_frame


class EchoHandler:
    """Answers ping on the loop and `delete` (standing for any job) on a thread; records
    sessions opened and closed."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1)
        self.remote_executor = ThreadPoolExecutor(1)
        self.stats_executor = ThreadPoolExecutor(1)
        self.jobs_in_flight: set[asyncio.Future[Any]] = set()
        self.opened: list[tuple[int, int]] = []
        self.closed: list[tuple[int, int]] = []
        self.session_closed = threading.Event()
        self.job_threads: list[str] = []

    def open_session(self, uid: int, pid: int) -> tuple[int, int]:
        self.opened.append((uid, pid))
        return (uid, pid)

    def close_session(self, session: tuple[int, int]) -> None:
        self.closed.append(session)
        self.session_closed.set()

    def adopt_descriptor(self, session: tuple[int, int], fd: int) -> None:
        os.close(fd)

    def is_inline(self, request: m._Request) -> bool:
        return type(request) is m.Ping

    def handle(self, session: tuple[int, int], request: m._Request) -> m._Reply | Deferred:
        if type(request) is m.Ping:
            return m.Pong(request.id)
        self.job_threads.append(threading.current_thread().name)
        return m.DeleteReply(request.id, 7)

    def stats_reply(self, request: m.Stats, received_s: float) -> m._Reply:
        return m.StatsReply(request.id, {"received_s": received_s})

    def close(self) -> None:
        for executor in (self.executor, self.remote_executor, self.stats_executor):
            executor.shutdown()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, EchoHandler]]:
    """A `ControlServer` serving an `EchoHandler` on a socket, its loop on a thread."""
    handler = EchoHandler()
    typed: RequestHandler[tuple[int, int]] = handler  # the protocol is all the server needs
    server = ControlServer(typed, max_frame_bytes=1 << 20, max_inflight_per_client=4)
    path = tmp_path / "k.sock"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(str(path)), loop).result(10)
    try:
        yield path, handler
    finally:
        asyncio.run_coroutine_threadsafe(server.close(drain_timeout_s=5), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        handler.close()


def ask(sock: socket.socket, request: m._Request) -> m._Reply:
    sock.sendall(pack_frame(m.encoder.encode(request)))
    return m.reply_decoder.decode(recv_frame(sock, 1 << 20))


def test_the_server_module_does_not_import_the_service() -> None:
    code = "import sys, kvtier.daemon.server; print('kvtier.daemon.service' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)

    assert done.stdout.strip() == "False"


def test_any_handler_answers_inline_and_threaded_requests_and_ends_the_session(
        served: tuple[Path, EchoHandler]) -> None:
    path, handler = served
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))

        pong = ask(sock, m.Ping(1))
        deleted = ask(sock, m.Delete(2, 1, [bytes(16)]))
        stats = ask(sock, m.Stats(3))
        sock.sendall(pack_frame(b"\xc1"))  # not msgpack
        bad = m.reply_decoder.decode(recv_frame(sock, 1 << 20))

    assert isinstance(pong, m.Pong) and pong.id == 1
    assert isinstance(deleted, m.DeleteReply) and deleted.num_deleted == 7
    assert handler.job_threads and handler.job_threads[0] != threading.main_thread().name
    assert isinstance(stats, m.StatsReply) and "received_s" in stats.stats
    assert isinstance(bad, m.Error) and bad.code == "bad_request" and bad.id == 0
    assert handler.opened == [(os.getuid(), os.getpid())]
    assert handler.session_closed.wait(10)  # the server's loop ends it when the socket closes
    assert handler.closed == handler.opened
