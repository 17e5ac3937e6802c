"""The kvtier daemon: startup -> main loop -> shutdown, inside signal capture.

Startup claims the socket (a lock file beside it; a second daemon refuses with a clear message;
a stale socket from a crashed daemon is replaced), opens the page store off the event loop
(pre-faulting takes a while), then listens, logs "kvtier ready" and tells systemd so (sd_notify,
when run as a `Type=notify` service). With `metrics_port` set, the Prometheus endpoint is bound
first of all, so a taken port stops the start before any socket or arena exists. SIGTERM or
SIGINT: stop accepting, let jobs in flight finish, close connections, flush the disk index, exit 0.
While it serves, the garbage collector is kept off the page table (`kvtier.daemon.heap`), and
housekeeping gives back the memory of host arena chunks left empty and of large requests.

The socket's directory is where another local user could attack: it must be ours and writable
by no one else (a directory another user made, or a group- or world-writable one, is refused),
and the lock file is opened without following links. The socket is 0600 unless other uids are
allowed (`daemon.allowed_uids`): then 0660 with `daemon.socket_group`, else 0666 with the peer
uid check (SO_PEERCRED) as the only gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import grp
import logging
import os
import signal
import stat
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.daemon.heap import (
    FREEZE_INTERVAL_S,
    HeapKeeper,
    give_arena_memory_back,
    give_memory_back,
)
from kvtier.daemon.limits import FD_RESERVE, FdBudget, raise_fd_limit
from kvtier.daemon.notify import notify_ready, notify_stopping
from kvtier.daemon.server import ControlServer
from kvtier.daemon.service import Service
from kvtier.daemon.settings import DaemonConfig
from kvtier.errors import DaemonError
from kvtier.shm import reclaim_orphans
from kvtier.sizes import format_bytes
from kvtier.store.page_store import PageStore

if TYPE_CHECKING:
    from kvtier.daemon.metrics import MetricsEndpoint

log = logging.getLogger("kvtier.daemon.process")

READY_MESSAGE = "kvtier ready"
HOUSEKEEPING_INTERVAL_S = 1.0
GIL_SWITCH_INTERVAL_S = 0.0005
MAX_SOCKET_PATH_BYTES = 108  # sizeof(sun_path) on Linux
SCRAPE_TIMEOUT_S = 5.0  # a scrape waits this long for the stats thread's snapshot


@dataclass(slots=True, frozen=True)
class SocketAccess:
    """Who may reach the socket through the file system: its mode and group, its directory's."""

    socket_mode: int = 0o600
    directory_mode: int = 0o700
    gid: int = -1  # -1: leave the group as created

    @classmethod
    def of(cls, config: DaemonConfig) -> SocketAccess:
        """Private to our uid, unless `config` allows other uids or names a socket group.

        Raises:
            DaemonError: `daemon.socket_group` names no group.
        """
        if config.socket_group:
            try:
                gid = (int(config.socket_group) if config.socket_group.isdigit()
                       else grp.getgrnam(config.socket_group).gr_gid)
            except KeyError:
                raise DaemonError(f"daemon.socket_group: no group named "
                                  f"{config.socket_group!r}") from None
            return cls(0o660, 0o710, gid)
        if config.allowed_uids:
            # No group to share: the file system lets every uid reach the socket, and the peer
            # uid check (SO_PEERCRED) refuses those not allowed.
            return cls(0o666, 0o711)
        return cls()


class SocketClaim:
    """Exclusive ownership of a socket path, through an flock'd lock file beside it."""

    def __init__(self, socket_path: Path, access: SocketAccess = SocketAccess()) -> None:
        self.socket_path = socket_path
        self.lock_path = socket_path.with_name(socket_path.name + ".lock")
        self.access = access
        self._fd: int | None = None

    def acquire(self) -> None:
        """Claim the path, replacing a stale socket.

        Raises:
            DaemonError: another live daemon serves this socket, the path is too long for a
                Unix socket, or the directory or lock file is unusable or not safely ours.
        """
        num_path_bytes = len(os.fsencode(str(self.socket_path)))
        if num_path_bytes > MAX_SOCKET_PATH_BYTES:
            raise DaemonError(f"socket path {self.socket_path} is {num_path_bytes} bytes; a Unix "
                              f"socket path holds at most {MAX_SOCKET_PATH_BYTES}: pass a "
                              f"shorter --socket")
        self._claim_directory()
        try:
            # O_NOFOLLOW: a link planted here must not make us truncate and write its target.
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as exc:
            raise DaemonError(f"cannot open lock file {self.lock_path}: {exc.strerror or exc}"
                              + (" (a symbolic link: remove it)"
                                 if exc.errno == errno.ELOOP else "")) from exc
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
            os.close(fd)
            raise DaemonError(f"lock file {self.lock_path} is not a plain file of our own (owner "
                              f"uid {info.st_uid}, {info.st_nlink} links): remove it")
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

    def _claim_directory(self) -> None:
        """Create the socket's directory, or check that the one there is ours and private.

        Another user who made it first (the default under the temp dir is a guessable name),
        or who may write into it, could replace the socket with one of their own.
        """
        directory, access = self.socket_path.parent, self.access
        # Missing parents are made too (a fresh runtime dir), and said: a typo in --socket
        # shows in the log instead of as a silent new tree.
        missing_parents = [parent for parent in directory.parents if not parent.exists()]
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(directory, access.directory_mode)
                os.chown(directory, -1, access.gid)
                os.chmod(directory, access.directory_mode)  # exactly, whatever the umask
                log.info("created socket directory %s (mode %04o)%s", directory,
                         access.directory_mode,
                         f" and its missing parents "
                         f"{', '.join(map(str, reversed(missing_parents)))}"
                         if missing_parents else "")
            except FileExistsError:
                pass
            info = os.stat(directory)
        except OSError as exc:
            raise DaemonError(f"cannot use socket directory {directory}: {exc}") from exc
        if not stat.S_ISDIR(info.st_mode):
            raise DaemonError(f"socket directory {directory} is not a directory")
        if info.st_uid != os.geteuid():
            raise DaemonError(f"socket directory {directory} belongs to uid {info.st_uid}, not to "
                              f"us (uid {os.geteuid()}): another user may have made it; remove "
                              f"it or pass another --socket")
        if info.st_mode & 0o022:
            raise DaemonError(f"socket directory {directory} is writable by "
                              f"{'others' if info.st_mode & 0o002 else 'its group'} (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}): anyone there could replace "
                              f"the socket; chmod go-w it or pass another --socket")
        if access.socket_mode & 0o077 and not info.st_mode & 0o011:
            log.warning("socket directory %s is mode %04o: the other uids allowed to connect "
                        "cannot reach the socket through it (they need search permission)",
                        directory, stat.S_IMODE(info.st_mode))

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
        # The event loop answers every client; a copy or bulk thread running Python holds the
        # GIL for up to the switch interval each time the loop wants it back (5 ms by default,
        # several times per request): 0.5 ms keeps a neighbour's round trip near its idle time.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        run: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
        try:
            import uvloop
        except ImportError:  # no traceback of the daemon should carry this one
            pass
        else:
            run = uvloop.run
        run(self._main())

    async def _main(self) -> None:
        endpoint = None
        if self.config.metrics_port is not None:
            from kvtier.daemon.metrics import (
                MetricsEndpoint,  # prometheus_client: only when asked for
            )

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
        claim = SocketClaim(self.config.socket_path, SocketAccess.of(self.config))
        claim.acquire()
        fd_budget = FdBudget(raise_fd_limit())
        orphans = reclaim_orphans()
        if orphans:
            log.warning("removed %d shared-memory segments left by dead processes: %s",
                        len(orphans), ", ".join(orphans[:5]))
        try:
            # Opening the store pre-faults the arena and recovers the disk index: off the loop.
            store = await loop.run_in_executor(None, PageStore, self.config.store)
            try:
                await self._serve(store, claim, stop, endpoint, fd_budget)
            finally:
                store.close()
                log.info("kvtier stopped%s", "; disk index flushed" if store.disk else "")
        finally:
            claim.release()

    @staticmethod
    async def _tend_heap_until(keeper: HeapKeeper, stop: asyncio.Event) -> None:
        """Every FREEZE_INTERVAL_S until `stop`, keep the garbage collector's walks short
        (`HeapKeeper`): a full walk of a large page table stalls every client."""
        keeper.freeze_survivors()  # what start-up made lives as long as the daemon
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=FREEZE_INTERVAL_S)
            except TimeoutError:
                keeper.tend()

    @staticmethod
    async def _housekeep_until(store: PageStore, server: ControlServer, stop: asyncio.Event,
                               client_pids: set[int]) -> None:
        """Every HOUSEKEEPING_INTERVAL_S until `stop`: make disk index updates durable, unlink
        the pool segments of this daemon's clients (`client_pids`) that died (a SIGKILLed
        client cannot), give the memory of host arena chunks left with no page back to the system,
        and after large requests the heap memory they freed (the tables they emptied too)."""
        loop = asyncio.get_running_loop()
        last_failure = ""
        num_large_frames = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=HOUSEKEEPING_INTERVAL_S)
            except TimeoutError:
                pass
            else:
                break
            try:
                await loop.run_in_executor(None, store.flush)
                # Only its own clients' segments: one whose creator never connected here may be
                # another daemon's client's, for that daemon to reclaim and account for.
                for name in await loop.run_in_executor(None, reclaim_orphans, ("kvtier-pool-",),
                                                       frozenset(client_pids)):
                    log.info("removed the pool segment %s of client pid %s, which died", name,
                             name.split("-")[2])
                await loop.run_in_executor(None, give_arena_memory_back, store)
                if server.num_large_frames != num_large_frames and not server.inflight:
                    num_large_frames = server.num_large_frames
                    await loop.run_in_executor(None, store.shrink)  # before the trim: its tables
                    await loop.run_in_executor(None, give_memory_back)
            except Exception as exc:  # e.g. EMFILE: housekeeping waits a turn, serving goes on
                failure = f"{type(exc).__name__}: {exc}"
                if failure != last_failure:
                    log.error("housekeeping failed (retrying every %.0f s): %s",
                              HOUSEKEEPING_INTERVAL_S, failure)
                last_failure = failure
            else:
                if last_failure:
                    log.info("housekeeping works again")
                last_failure = ""

    async def _serve(self, store: PageStore, claim: SocketClaim, stop: asyncio.Event,
                     endpoint: MetricsEndpoint | None, fd_budget: FdBudget) -> None:
        loop = asyncio.get_running_loop()
        limits = self.config.limits
        service = Service(store, self.config.copy_threads, limits, fd_budget,
                          max_namespaces_per_client=self.config.max_namespaces_per_client,
                          max_namespaces_per_peer=self.config.max_namespaces_per_peer)

        def snapshot() -> dict:
            """`service.scrape()` for a scrape, on the stats thread (never on the loop)."""
            return service.stats_executor.submit(service.scrape).result(SCRAPE_TIMEOUT_S)

        keeper = HeapKeeper()
        server = ControlServer(service, self.config.max_frame_bytes,
                               self.config.max_inflight_per_client, self.config.allowed_uids,
                               limits, fd_budget, watch_released=keeper.watch)
        try:
            await server.start(str(claim.socket_path), claim.access.socket_mode, claim.access.gid)
            log.info("open-file limit %d: room for %d connections and pools (at most %d "
                     "clients, %d pools each)", fd_budget.capacity + FD_RESERVE,
                     fd_budget.capacity, limits.max_clients, limits.max_pools_per_client)
            if endpoint is not None:  # before the ready line: a scrape after it sees everything
                endpoint.serve(snapshot, fd_budget)
            stats = store.stats()
            remote = store.remote
            # The chunks the tiers use, not the settings': start may have lowered them.
            _log_capacity_taken("host", self.config.store.host.capacity_bytes,
                                stats.tier("host").capacity_bytes, store.host.slots.chunk_bytes)
            if store.disk is not None:
                _log_capacity_taken("disk", self.config.store.disk.capacity_bytes,
                                    store.disk.capacity_bytes, store.disk.slots.chunk_bytes)
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
            heap = asyncio.create_task(self._tend_heap_until(keeper, stop))
            await self._housekeep_until(store, server, stop, service.client_pids)
            await heap
            notify_stopping()
            log.info("shutting down: %d requests in flight", server.num_requests_in_flight)
        finally:
            if endpoint is not None:  # no scrape may wait on a loop that stops answering
                await loop.run_in_executor(None, endpoint.close)
            await server.close()
            with contextlib.suppress(Exception):
                service.close()


def _log_capacity_taken(tier: str, asked_bytes: int, taken_bytes: int, chunk_bytes: int) -> None:
    """Say so when a tier took less than its capacity setting asked for: tiers come in whole
    chunks, and "10GB" is 10^9-byte gigabytes, 7% less than the 10GiB a reader may have meant."""
    if taken_bytes == asked_bytes:
        return
    log.info("%s tier: %s.capacity asked for %d bytes (%s), took %s: a tier is whole %s chunks "
             "(%s.chunk); KB, MB, GB, TB are decimal (10^3 ...), KiB, MiB, GiB, TiB binary "
             "(2^10 ...)", tier, tier, asked_bytes, format_bytes(asked_bytes),
             format_bytes(taken_bytes), format_bytes(min(chunk_bytes, asked_bytes)), tier)

