"""The metrics endpoint costs the page service little, whatever scrapers do (issue #24, finding 4).

Before: every scrape took its stats snapshot on the event loop (16 looping scrapers made a
neighbour's ping p50 x46), and prometheus_client's server started a thread per connection and
waited on it for ever (1,000 slow connections: 1,000 threads and descriptors, outside the
daemon's budget). Now snapshots are taken off the loop and shared by the scrapes that wait on
one; connections are bounded in number, time out, and hold descriptors of the daemon's budget.
"""

from __future__ import annotations

import shutil
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvtier.testing import daemon as harness

# kvtier.daemon.metrics_http's MAX_SCRAPE_CONNECTIONS and MAX_SCRAPE_THREADS, as written here
# so that this module also runs (and fails) against a daemon without them
MAX_SCRAPE_CONNECTIONS, MAX_SCRAPE_THREADS = 64, 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
        assert reply.status == 200
        return reply.read()


@pytest.fixture
def metrics_daemon(tmp_path: Path) -> Iterator[tuple[harness.DaemonProcess, int]]:
    socket_dir = harness.short_socket_dir()
    port = free_port()
    process = harness.DaemonProcess.start(socket_dir / "k.sock", tmp_path / "disk",
                                          "--metrics-port", str(port))
    try:
        yield process, port
        process.stop_and_check()
    finally:
        if process.running:
            process.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_looping_scrapers_share_snapshots(metrics_daemon) -> None:
    process, port = metrics_daemon
    num_scrapers, scrapes_each = 16, 10
    with process.client() as client:
        before = client.stats()["latency"].get("scrape", {}).get("total", 0)
        threads = [threading.Thread(target=lambda: [scrape(port) for _ in range(scrapes_each)])
                   for _ in range(num_scrapers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        snapshots = client.stats()["latency"]["scrape"]["total"] - before

    # One snapshot per scrape before; scrapes arriving during one now share the next.
    assert 1 <= snapshots < num_scrapers * scrapes_each * 0.75, snapshots


def test_slow_connections_are_bounded_and_take_no_thread_each(metrics_daemon) -> None:
    process, port = metrics_daemon
    scrape(port)
    daemon = psutil.Process(process.pid)
    threads_before = daemon.num_threads()
    slow = [socket.create_connection(("127.0.0.1", port), timeout=60)
            for _ in range(MAX_SCRAPE_CONNECTIONS + 36)]
    try:
        for sock in slow:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        peak_threads = daemon.num_threads()
        with process.client() as client:
            client.ping()  # the page service is untouched
        # Each is closed by the daemon: at once past the slots, after its timeout within them
        # (before: every one held by a thread of its own, for ever).
        for sock in slow:
            assert sock.recv(1024) == b""
            peak_threads = max(peak_threads, daemon.num_threads())
        assert peak_threads <= threads_before + MAX_SCRAPE_THREADS
    finally:
        for sock in slow:
            sock.close()
    assert scrape(port)


def test_a_connection_that_stops_sending_is_dropped_after_its_timeout() -> None:
    from kvtier.daemon import metrics_http
    from kvtier.daemon.metrics_http import ScrapeServer

    assert (metrics_http.MAX_SCRAPE_CONNECTIONS,
            metrics_http.MAX_SCRAPE_THREADS) == (MAX_SCRAPE_CONNECTIONS, MAX_SCRAPE_THREADS)
    server = ScrapeServer("127.0.0.1", 0, lambda: (b"ok\n", "text/plain"), max_connections=2,
                          max_threads=2, timeout_s=0.5)
    server.serve_in_thread()
    try:
        port = server.server_address[1]
        stalled = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
        for sock in stalled:
            sock.sendall(b"GET / HTTP/1.1\r\n")
            assert sock.recv(1024) == b""  # closed by the server, not held for ever
            sock.close()
        assert scrape(port) == b"ok\n"  # the slots are free again
    finally:
        server.close()


def test_a_connection_that_trickles_is_dropped_at_its_deadline() -> None:
    """One byte per half timeout never trips the per-read timeout; the exchange's deadline ends it
    (before: a trickling client held its worker for as long as it kept sending)."""
    from kvtier.daemon.metrics_http import ScrapeServer

    server = ScrapeServer("127.0.0.1", 0, lambda: (b"ok\n", "text/plain"), max_connections=2,
                          max_threads=1, timeout_s=5.0, deadline_s=1.0)
    server.serve_in_thread()
    try:
        port = server.server_address[1]
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        with sock:
            sock.sendall(b"GET / HTTP/1.1\r\n")
            sock.settimeout(0.2)  # between trickled bytes: well inside the per-read timeout
            closed = False
            for _ in range(150):  # 30 s of trickling at most
                try:
                    closed = sock.recv(1024) == b""
                except TimeoutError:
                    pass
                except ConnectionError:
                    closed = True
                if closed:
                    break
                try:
                    sock.sendall(b"X")  # one header byte
                except ConnectionError:
                    closed = True
                    break
            assert closed, "a trickling client still held its worker after 30 s"
        assert scrape(port) == b"ok\n"  # the one worker serves again
    finally:
        server.close()
