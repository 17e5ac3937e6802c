"""The HTTP server Prometheus scrapes, bounded: `ScrapeServer`.

prometheus_client's own server starts a thread per connection and waits on each for ever: 1,000
slow connections were 1,000 threads and descriptors, outside the daemon's budget. This one
serves `max_threads` connections at once on a fixed pool of threads, lets at most
`max_connections` wait or be served, and closes the others as it accepts them. Each connection
has `timeout_s` per read and write (a client that stops sending or reading is dropped) and
`deadline_s` for the whole exchange once a worker serves it (a client that trickles a byte per
timeout is dropped too), and takes its descriptor from the daemon's `FdBudget` once the daemon
serves. What it answers, on any path, is what one `render()` callable returns.
Verbs: `ScrapeServer` (binds), `serve_in_thread`, `close`.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import Any

from kvtier.daemon.limits import FdBudget

log = logging.getLogger(__name__)

MAX_SCRAPE_THREADS = 8  # scrapes served at once; Prometheus scrapes a target once per interval
MAX_SCRAPE_CONNECTIONS = 64  # served or waiting for a thread; past it, closed as accepted
# Per read and per write: a scrape's request arrives in one packet and its reply fits the socket
# buffers, so a client silent for this long is broken or hostile.
SCRAPE_CONNECTION_TIMEOUT_S = 2.0
# The whole exchange, request to last byte of the reply: per-read timeouts alone let a client
# that sends one byte per timeout hold a worker for ever (eight such took every scrape).
SCRAPE_DEADLINE_S = 10.0

Render = Callable[[], tuple[bytes, str]]  # (body, content type)


class _ScrapeHandler(BaseHTTPRequestHandler):
    """One scrape: GET (any path) answers the rendered metrics."""

    server: ScrapeServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        body, content_type = self.server.render()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # no access log on stderr: it would break the daemon's JSON log lines


class ScrapeServer(socketserver.TCPServer):
    """Listens on `address`:`port` at construction (OSError if it cannot)."""

    allow_reuse_address = True  # a restart binds again at once; two listeners still conflict
    request_queue_size = 128  # connections past the slots are accepted to be closed, not left

    def __init__(self, address: str, port: int, render: Render,
                 max_connections: int = MAX_SCRAPE_CONNECTIONS,
                 max_threads: int = MAX_SCRAPE_THREADS,
                 timeout_s: float = SCRAPE_CONNECTION_TIMEOUT_S,
                 deadline_s: float = SCRAPE_DEADLINE_S) -> None:
        self.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        super().__init__((address, port), _ScrapeHandler)
        self.render = render
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.fd_budget: FdBudget | None = None  # set when the daemon serves
        self._slots = threading.BoundedSemaphore(max_connections)
        self._workers = ThreadPoolExecutor(max_threads, thread_name_prefix="kvtier-metrics")
        self._thread: threading.Thread | None = None
        self._deadlines = _Deadlines()

    def serve_in_thread(self) -> None:
        """Accept connections on a thread of its own until `close`."""
        self._thread = threading.Thread(target=self.serve_forever, name="kvtier-metrics-accept",
                                        daemon=True)
        self._thread.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """On the accepting thread: hand the connection to a worker, or close it at once when
        every slot is taken or the daemon has no descriptor to spare."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        budget = self.fd_budget
        if budget is not None and not budget.try_take(1):
            self._slots.release()
            self.shutdown_request(request)
            return
        request.settimeout(self.timeout_s)
        self._workers.submit(self._serve_one, request, client_address, budget)

    def _serve_one(self, request: socket.socket, client_address: Any,
                   budget: FdBudget | None) -> None:
        self._deadlines.watch(request, time.monotonic() + self.deadline_s)
        try:
            self.finish_request(request, client_address)
        except Exception as exc:  # a client that timed out or went away: its loss only
            log.debug("metrics connection from %s ended: %s", client_address, exc)
        finally:
            self._deadlines.forget(request)
            self.shutdown_request(request)
            if budget is not None:
                budget.give_back(1)
            self._slots.release()

    def close(self) -> None:
        """Stop accepting, finish the scrapes being served, release the port (idempotent)."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()
        self._workers.shutdown(wait=True)
        self._deadlines.close()


class _Deadlines:
    """One thread that shuts each watched socket at its deadline, so the worker's blocked read or
    write returns (a thread per connection would double the threads the server bounds)."""

    def __init__(self) -> None:
        self._due: dict[socket.socket, float] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-metrics-deadlines",
                                        daemon=True)
        self._thread.start()

    def watch(self, request: socket.socket, due: float) -> None:
        with self._changed:
            self._due[request] = due
            self._changed.notify()

    def forget(self, request: socket.socket) -> None:
        with self._changed:
            self._due.pop(request, None)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                now = time.monotonic()
                for request in [r for r, due in self._due.items() if due <= now]:
                    del self._due[request]
                    try:
                        request.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # closed by its worker meanwhile
                wait = min(self._due.values(), default=now + 60.0) - now
                self._changed.wait(max(wait, 0.0))
