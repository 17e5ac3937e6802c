"""The kvtier daemon: startup -> main loop -> shutdown, inside signal capture.

Startup claims the socket (a lock file beside it; a second daemon refuses with a clear message;
a stale socket from a crashed daemon is replaced), opens the page store off the event loop
(pre-faulting takes a while), then listens, logs "kvtier ready" and tells systemd so (sd_notify,
when run as a `Type=notify` service). With `metrics_port` set, the Prometheus endpoint is bound
first of all, so a taken port stops the start before any socket or arena exists. SIGTERM or
SIGINT: stop accepting, let jobs in flight finish, close connections, flush the disk index, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.ipc.server import ControlServer
from kvtier.notify import notify_ready, notify_stopping
from kvtier.service import Service
from kvtier.settings import DaemonConfig
from kvtier.shm import reclaim_orphans
from kvtier.store import PageStore

if TYPE_CHECKING:
    from kvtier.metrics import MetricsEndpoint

log = logging.getLogger("kvtier.daemon")

READY_MESSAGE = "kvtier ready"
HOUSEKEEPING_INTERVAL_S = 1.0
SCRAPE_TIMEOUT_S = 5.0  # a scrape waits this long for the event loop's stats snapshot


class DaemonError(KvtierError):
    """The daemon cannot start (socket in use, bad directory)."""

    code = "daemon"


class SocketClaim:
    """Exclusive ownership of a socket path, through an flock'd lock file beside it."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.lock_path = socket_path.with_name(socket_path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Claim the path, replacing a stale socket.

        Raises:
            DaemonError: another live daemon serves this socket, or the directory is unusable.
        """
        try:
            self.socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise DaemonError(f"cannot use socket directory {self.socket_path.parent}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DaemonError(f"another kvtier daemon (pid {owner}) is serving {self.socket_path}; "
                              f"stop it first or pass another --socket") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        # We hold the lock, so a socket file left here belongs to a daemon that died.
        self.socket_path.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the socket and the lock file (idempotent)."""
        if self._fd is None:
            return
        self.socket_path.unlink(missing_ok=True)
        self.lock_path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


class Daemon:
    """One kvtier daemon process."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT. Uses uvloop when it is installed.

        Raises:
            KvtierError: start-up failed (the message says why).
        """
        # Whatever umask we were started with, nothing we create (directories the socket or the
        # disk tier need, LMDB's files) is readable by other users; explicit modes stay too.
        os.umask(0o077)
        try:
            import uvloop
        except ImportError:  # no traceback of the daemon should carry this one
            uvloop = None
        run = uvloop.run if uvloop is not None else asyncio.run
        run(self._main())

    async def _main(self) -> None:
        endpoint = None
        if self.config.metrics_port is not None:
            from kvtier.metrics import MetricsEndpoint  # prometheus_client: only when asked for

            endpoint = MetricsEndpoint.bind(self.config.metrics_address, self.config.metrics_port)
        try:
            await self._claim_and_run(endpoint)
        finally:
            if endpoint is not None:
                endpoint.close()

    async def _claim_and_run(self, endpoint: MetricsEndpoint | None) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        claim = SocketClaim(self.config.socket_path)
        claim.acquire()
        orphans = reclaim_orphans()
        if orphans:
            log.warning("removed %d shared-memory segments left by dead processes: %s",
                        len(orphans), ", ".join(orphans[:5]))
        try:
            # Opening the store pre-faults the arena and recovers the disk index: off the loop.
            store = await loop.run_in_executor(None, PageStore, self.config.store)
            try:
                await self._serve(store, claim, stop, endpoint)
            finally:
                store.close()
                log.info("kvtier stopped%s", "; disk index flushed" if store.disk else "")
        finally:
            claim.release()

    @staticmethod
    async def _housekeep_until(store: PageStore, stop: asyncio.Event) -> None:
        """Every HOUSEKEEPING_INTERVAL_S until `stop`: make disk index updates durable, and
        unlink the pool segments of clients that died (a SIGKILLed client cannot)."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=HOUSEKEEPING_INTERVAL_S)
            except TimeoutError:
                await loop.run_in_executor(None, store.flush)
                for name in await loop.run_in_executor(None, reclaim_orphans, ("kvtier-pool-",)):
                    log.info("removed the pool segment %s of a client that died", name)

    async def _serve(self, store: PageStore, claim: SocketClaim, stop: asyncio.Event,
                     endpoint: MetricsEndpoint | None) -> None:
        loop = asyncio.get_running_loop()
        service = Service(store, self.config.copy_threads,
                          max_namespaces_per_client=self.config.max_namespaces_per_client)

        def snapshot() -> dict:
            """`service.scrape()`, taken on the loop like the stats verb: called by scrapes."""
            async def take() -> dict:
                return service.scrape()

            return asyncio.run_coroutine_threadsafe(take(), loop).result(SCRAPE_TIMEOUT_S)

        server = ControlServer(service, self.config.max_frame_bytes,
                               self.config.max_inflight_per_client, self.config.allowed_uids)
        try:
            await server.start(str(claim.socket_path))
            if endpoint is not None:  # before the ready line: a scrape after it sees everything
                endpoint.serve(snapshot)
            stats = store.stats()
            remote = store.remote
            log.info("%s on %s (host %d MiB, disk %s, remote %s, pid %d)", READY_MESSAGE,
                     claim.socket_path, stats.tier("host").capacity_bytes >> 20,
                     f"{store.disk.capacity_bytes >> 20} MiB at {store.disk.path}"
                     if store.disk is not None else "off",
                     "off" if remote is None else
                     f"{remote.url} ({'connected' if remote.connected else 'unreachable'})",
                     os.getpid())
            if endpoint is not None:
                log.info("metrics on %s", endpoint.url)
            notify_ready(f"serving {claim.socket_path}")
            await self._housekeep_until(store, stop)
            notify_stopping()
            log.info("shutting down: %d requests in flight", server.num_requests_in_flight)
        finally:
            if endpoint is not None:  # no scrape may wait on a loop that stops answering
                await loop.run_in_executor(None, endpoint.close)
            await server.close()
            with contextlib.suppress(Exception):
                service.close()
