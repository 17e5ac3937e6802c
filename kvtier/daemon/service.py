"""The daemon's verbs: what each control request does to the store, per client session.

`Service` is the control server's `RequestHandler`. A `Session` (kvtier.daemon.session) is one
connected client: its pools (open segment files, mapped GPU memory) and its leases, all released
when it disconnects or dies. `Service.handle` answers one request. Verbs that only touch the
page table (`is_inline`: lookup, ping, pin, ...) are answered on the event loop at once: a thread
hop would triple a lookup's latency. Verbs that copy pages or touch the disk (store, recall,
rotate, prefetch, delete, check), and unpin (as long as its lease), run in the copy thread pool,
`executor`, never on the loop; so do requests of thousands of keys (the server's bulk thread);
`stats` (milliseconds of numpy) runs on a thread of its own, `stats_executor`. Pools and
namespaces are registered through `PoolRegistry` (kvtier.daemon.pool_registry), within each
client's caps; a session holds at most `max_leases_per_client` leases, each at most
`max_lease_s` long. Copies between pools and the host arena go through the store's lanes: one
pair for shared-memory pools, and one per GPU, opened with its first device pool.
The daemon's own figures (latency per verb, bytes per lane) are kept by `ServiceStats`.
Verbs: hello, ping, register_pool, open_namespace, unregister_pool, lookup, lookup_index (where
the lookup plane's index of a namespace is: `kvtier.daemon.lookup_plane`), store, recall, rotate,
prefetch, pin, unpin, delete, stats, check.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import msgspec

from kvtier import __version__
from kvtier.daemon.handler import Deferred
from kvtier.daemon.limits import DEFAULT_LIMITS, FdBudget, Limits, raise_fd_limit
from kvtier.daemon.lookup_plane import LookupPlane
from kvtier.daemon.pool_registry import PoolRegistry
from kvtier.daemon.service_stats import ServiceStats
from kvtier.daemon.session import RegisteredPool, Session
from kvtier.errors import KvtierError, ProtocolError, QuotaError
from kvtier.ipc import messages as m
from kvtier.keys import Namespace, check_keys
from kvtier.pools.layout import PoolLayout
from kvtier.pools.pool_pages import PoolPageAccess
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier, present_prefix
from kvtier.store.results import LookupResult
from kvtier.transfer.cpu import default_copy_threads

log = logging.getLogger(__name__)
LOOKUP_SLICE_KEYS = 4096  # keys looked up per hold of the store's lock


class Service:
    """Answers control requests against one `PageStore`."""

    def __init__(self, store: PageStore, copy_threads: int, limits: Limits = DEFAULT_LIMITS,
                 fd_budget: FdBudget | None = None, max_namespaces_per_client: int = 64,
                 max_namespaces_per_peer: int = 64) -> None:
        self.store = store
        self.limits = limits
        self.pools = PoolRegistry(store, limits, fd_budget or FdBudget(raise_fd_limit()),
                                  max_namespaces_per_client, max_namespaces_per_peer,
                                  lane_copy_threads=min(copy_threads, default_copy_threads()))
        self.executor = ThreadPoolExecutor(copy_threads, thread_name_prefix="kvtier-copy")
        # Lookups waiting on the remote tier get their own threads: they must not queue behind
        # copies, nor copies behind them.
        self.remote_executor = ThreadPoolExecutor(copy_threads, thread_name_prefix="kvtier-remote")
        # One thread decodes (and answers, for lookup and pin) the frames of thousands of keys:
        # Python work that holds the GIL, which the loop then waits on behind one thread only.
        self.bulk_executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-bulk")
        # One thread: a flood of stats requests shares snapshots instead of taking every thread.
        self.stats_executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-stats")
        # (started_s, figures) of the last snapshot, shared by the stats requests that wait on it
        self._stats_snapshot: tuple[float, dict[str, Any]] = (float("-inf"), {})
        self._sessions: dict[int, Session] = {}
        # Every client pid this daemon served: housekeeping tells a dead client's pool segment
        # from one some other process left.
        self.client_pids: set[int] = set()
        self._client_ids = itertools.count(1)
        self._figures = ServiceStats()
        # Requests being answered off the loop: the control server adds and discards their
        # futures; stats reports how many.
        self.jobs_in_flight: set[asyncio.Future[Any]] = set()
        # The stats requests among them: a snapshot does not count them (an idle daemon showed
        # the very request asking as a job in flight).
        self.stats_in_flight: set[asyncio.Future[Any]] = set()
        handlers: dict[type[m._Request], Callable[[Session, Any], m._Reply | Deferred]] = {
            m.Hello: self._hello, m.Ping: self._ping, m.RegisterPool: self._register_pool,
            m.OpenNamespace: self._open_namespace, m.UnregisterPool: self._unregister_pool,
            m.Lookup: self._lookup, m.LookupIndex: self._lookup_index,
            m.Store: self._store, m.Recall: self._recall, m.Rotate: self._rotate,
            m.Prefetch: self._prefetch,
            m.Pin: self._pin, m.Unpin: self._unpin, m.Delete: self._delete,
            m.Check: self._check,
        }
        # With each handler its verb's name, for the latency figures (msgspec builds a fresh
        # config object per `__struct_config__` read: a tenth of a lookup's time here).
        # msgspec allows int tags too; every verb's is a str.
        self._handlers = {kind: (handler, cast(str, kind.__struct_config__.tag))
                          for kind, handler in handlers.items()}
        # Not unpin: its frame is small but its work is its lease's size (65,536 pages: tens of
        # ms on the loop); nothing waits on its reply.
        self._inline_verbs = {m.Hello, m.Ping, m.RegisterPool, m.OpenNamespace, m.UnregisterPool,
                              m.Lookup, m.LookupIndex, m.Pin}
        # The lookup plane answers what the page table holds; a remote tier would lengthen
        # prefixes past it, so with one every lookup asks the daemon.
        self.lookup_plane = LookupPlane(store) if store.remote is None else None

    def is_inline(self, request: m._Request) -> bool:
        """Whether `request` is answered on the event loop (no copies, no disk I/O)."""
        if type(request) is m.RegisterPool and request.cuda_ipc_handle is not None:
            return False  # a GPU pool may start a CUDA engine: kernels compiled, arena pinned
        return type(request) in self._inline_verbs

    def open_session(self, uid: int, pid: int) -> Session:
        """A new client connected."""
        session = Session(next(self._client_ids), uid, pid)
        self.client_pids.add(pid)
        self._sessions[session.client_id] = session
        return session

    def adopt_descriptor(self, session: Session, fd: int) -> None:
        """Keep a descriptor received on the session's connection for its next register_pool;
        one still waiting there (a client that sent two) is closed."""
        self._drop_passed_fd(session)
        session.passed_fd = fd

    def _drop_passed_fd(self, session: Session) -> None:
        if session.passed_fd >= 0:
            os.close(session.passed_fd)
            session.passed_fd = -1
            self.pools.fd_budget.give_back(1)

    def close_session(self, session: Session) -> None:
        """A client left (or died): unmap its pools, end its leases. The leases end on the bulk
        thread, not the loop (a client may leave holding 16 leases of 65,536 pages: a million
        unpins); the session counts as connected until they have."""
        self._drop_passed_fd(session)
        for pool in session.pools.values():
            pool.close()
        session.pools.clear()
        self.pools.release_namespaces(session)
        lease_ids = list(session.lease_ids)
        session.lease_ids.clear()
        if not lease_ids:
            self._sessions.pop(session.client_id, None)
            return
        try:
            self.bulk_executor.submit(self._end_leases, session, lease_ids)
        except RuntimeError:  # shutting down: the bulk thread is gone
            self._end_leases(session, lease_ids)

    def _end_leases(self, session: Session, lease_ids: list[int]) -> None:
        """Unpin a closed session's leases, then forget the session."""
        for lease_id in lease_ids:
            try:
                self.store.unpin(lease_id)
            except KvtierError:
                pass  # already expired
            except Exception:  # a bug must not leave the session counted for ever
                log.exception("internal error while ending lease %d", lease_id)
        self._sessions.pop(session.client_id, None)

    @property
    def num_sessions(self) -> int:
        """Clients connected now."""
        return len(self._sessions)

    def handle(self, session: Session, request: m._Request) -> m._Reply | Deferred:
        """The reply to one decoded request other than stats (`stats_reply` answers those, on
        `stats_executor`); never raises for bad input.

        Blocks for copies and disk I/O unless `is_inline(request)`: call it from `executor`.
        """
        started = time.perf_counter()
        handler, verb = self._handlers[type(request)]
        try:
            reply: m._Reply | Deferred = handler(session, request)
        except KvtierError as exc:
            reply = m.Error(request.id, exc.code, str(exc))
        except Exception as exc:  # a bug must not take the daemon down with it
            log.exception("internal error while handling %s", verb)
            reply = m.Error(request.id, "internal", f"internal error: {type(exc).__name__}: {exc}")
        self._figures.record_latency(verb, started)
        return reply

    @staticmethod
    def _keys(keys: list[bytes]) -> list[bytes]:
        # Only the count here: the store validates each key once.
        if len(keys) > m.MAX_KEYS_PER_REQUEST:
            raise ProtocolError(f"{len(keys)} keys in one request; the limit is "
                                f"{m.MAX_KEYS_PER_REQUEST}")
        return keys

    def _hello(self, session: Session, request: m.Hello) -> m._Reply:
        if request.version != m.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {request.version} is not supported; this "
                                f"daemon speaks version {m.PROTOCOL_VERSION}")
        session.name = request.client_name[:128]
        return m.HelloReply(request.id, m.PROTOCOL_VERSION, __version__,
                            self.store.host.segment_name, session.client_id)

    def _ping(self, session: Session, request: m.Ping) -> m._Reply:
        return m.Pong(request.id)

    def _register_pool(self, session: Session, request: m.RegisterPool) -> m._Reply:
        namespace = Namespace(**msgspec.structs.asdict(request.namespace))
        layout = PoolLayout(**msgspec.structs.asdict(request.layout))
        if request.cuda_ipc_handle is not None:
            pool_id = self.pools.register_device(session, namespace, layout, request)
        elif request.descriptor:
            fd, session.passed_fd = session.passed_fd, -1
            if fd < 0:
                raise ProtocolError("register_pool said a pool descriptor comes with it, but "
                                    "none arrived: send the memfd with the frame (SCM_RIGHTS)")
            pool_id = self.pools.register_sealed(session, namespace, layout, fd, request.segment)
        else:
            pool_id = self.pools.register_shared(session, namespace, layout, request.segment)
        return m.PoolReply(request.id, pool_id, layout.page_bytes)

    def _open_namespace(self, session: Session, request: m.OpenNamespace) -> m._Reply:
        namespace = Namespace(**msgspec.structs.asdict(request.namespace))
        return m.PoolReply(request.id, self.pools.open_namespace(session, namespace),
                           namespace.page_bytes)

    def _unregister_pool(self, session: Session, request: m.UnregisterPool) -> m._Reply:
        self.pools.unregister(session, request.pool)
        return m.Done(request.id)

    def _lookup(self, session: Session, request: m.Lookup) -> m._Reply | Deferred:
        pool = self.pools.pool(session, request.pool)
        keys = self._keys(request.keys)
        result = self._local_lookup(pool.namespace, keys)
        if self.store.remote_may_extend(result):
            started = time.perf_counter()

            def finish() -> m._Reply:
                try:
                    extended = self.store.extend_lookup(pool.namespace, keys, result)
                except Exception:  # the local answer stands; the failure is the remote's
                    log.exception("remote part of a lookup failed")
                    extended = result
                self._figures.record_latency("lookup_remote", started)
                return m.LookupTiersReply(request.id, extended.num_prefix, _labels(extended.tiers))

            return Deferred(finish)
        return m.LookupTiersReply(request.id, result.num_prefix, _labels(result.tiers))

    def _local_lookup(self, namespace: Namespace, keys: list[bytes]) -> LookupResult:
        """`store.lookup(..., remote=False)`, a slice of keys at a time: a lookup of thousands
        of keys (on a copy thread) takes the store's lock for a slice only, so the lookups
        answered on the loop meanwhile never wait for all of it."""
        if len(keys) <= LOOKUP_SLICE_KEYS:
            return self.store.lookup(namespace, keys, remote=False)
        tiers: list[Tier | None] = []
        for start in range(0, len(keys), LOOKUP_SLICE_KEYS):
            tiers += self.store.lookup(namespace, keys[start : start + LOOKUP_SLICE_KEYS],
                                       remote=False).tiers
        return LookupResult(present_prefix(tiers), tiers)

    def _lookup_index(self, session: Session, request: m.LookupIndex) -> m._Reply:
        pool = self.pools.pool(session, request.pool)
        if self.lookup_plane is None:
            return m.Error(request.id, "unavailable", "this daemon has a remote tier: lookups go "
                           "over the socket, which asks it")
        fd, generation, size_bytes = self.lookup_plane.index_for(pool.namespace)
        return m.LookupIndexReply(request.id, fd, generation, size_bytes)

    def _pool_pages(self, pool: RegisteredPool, keys: list[bytes],
                    page_ids: list[int]) -> PoolPageAccess:
        if len(page_ids) != len(keys):
            raise ProtocolError(f"{len(keys)} keys but {len(page_ids)} page ids")
        return pool.pages(page_ids)

    def _store(self, session: Session, request: m.Store) -> m._Reply:
        pool = self.pools.pool(session, request.pool)
        keys = self._keys(request.keys)
        if request.parent_key is not None:
            check_keys([request.parent_key])
        started = time.perf_counter()
        with pool.in_use():
            pages = self._pool_pages(pool, keys, request.page_ids)
            result = self.store.store(pool.namespace, keys, pages, request.parent_key)
        page_bytes = pool.namespace.page_bytes
        self._figures.count_lane("store", len(result.stored) * page_bytes, started)
        return m.JobReply(request.id, len(result.stored) + len(result.already_present),
                          list(result.failed), list(result.failed.values()))

    def _recall(self, session: Session, request: m.Recall) -> m._Reply:
        pool = self.pools.pool(session, request.pool)
        keys = self._keys(request.keys)
        started = time.perf_counter()
        with pool.in_use():
            pages = self._pool_pages(pool, keys, request.page_ids)
            result = self.store.recall(pool.namespace, keys, pages)
        page_bytes = pool.namespace.page_bytes
        self._figures.count_lane("recall", len(result.recalled) * page_bytes, started)
        return m.JobReply(request.id, len(result.recalled), list(result.failed),
                          list(result.failed.values()), result.missing, _labels(result.tiers))

    def _rotate(self, session: Session, request: m.Rotate) -> m._Reply:
        pool = self.pools.pool(session, request.pool)
        self._keys(request.out_keys + request.in_keys)
        if request.parent_key is not None:
            check_keys([request.parent_key])
        started = time.perf_counter()
        with pool.in_use():
            out_pages = self._pool_pages(pool, request.out_keys, request.out_page_ids)
            in_pages = self._pool_pages(pool, request.in_keys, request.in_page_ids)
            result = self.store.rotate(pool.namespace, request.out_keys, out_pages,
                                       request.in_keys, in_pages, request.parent_key)
        stored, recalled = result.stored, result.recalled
        page_bytes = pool.namespace.page_bytes
        self._figures.count_lane("store", len(stored.stored) * page_bytes, started)
        self._figures.count_lane("recall", len(recalled.recalled) * page_bytes, started)
        return m.RotateReply(request.id, len(stored.stored) + len(stored.already_present),
                             list(stored.failed), list(stored.failed.values()),
                             len(recalled.recalled), list(recalled.failed),
                             list(recalled.failed.values()), recalled.missing,
                             _labels(recalled.tiers))

    def _prefetch(self, session: Session, request: m.Prefetch) -> m._Reply:
        pool = self.pools.pool(session, request.pool)
        result = self.store.prefetch(pool.namespace, self._keys(request.keys))
        return m.JobReply(request.id, len(result.recalled), list(result.failed),
                          list(result.failed.values()), result.missing)

    def _pin(self, session: Session, request: m.Pin) -> m._Reply:
        pool = self.pools.pool(session, request.pool)
        max_lease_s = self.limits.max_lease_s
        # Refused, not clamped: a client that believes its pages pinned for longer than they
        # are would find them evicted without a word.
        if not 0 < request.ttl_s <= max_lease_s:
            raise ProtocolError(f"a lease needs a positive ttl_s of at most {max_lease_s:g} s "
                                f"(daemon.max_lease), got {request.ttl_s}; pin again before it "
                                f"ends to hold pages longer")
        if len(session.lease_ids) >= self.limits.max_leases_per_client:
            session.lease_ids &= self.store.live_leases(session.lease_ids)  # forget expired ones
            if len(session.lease_ids) >= self.limits.max_leases_per_client:
                raise QuotaError(f"this client holds {len(session.lease_ids)} leases, its limit "
                                 f"(daemon.max_leases_per_client); unpin some first")
        lease = self.store.pin(pool.namespace, self._keys(request.keys), request.ttl_s,
                               session.lease_ids, self.limits.max_pinned_share)
        session.lease_ids.add(lease.lease_id)
        return m.PinReply(request.id, lease.lease_id, len(lease.pinned), lease.missing)

    def _unpin(self, session: Session, request: m.Unpin) -> m._Reply:
        if request.lease not in session.lease_ids:
            raise ProtocolError(f"no live lease {request.lease} on this connection")
        session.lease_ids.discard(request.lease)
        self.store.unpin(request.lease)
        return m.Done(request.id)

    def _delete(self, session: Session, request: m.Delete) -> m._Reply:
        pool = self.pools.pool(session, request.pool)
        num_deleted = self.store.delete(pool.namespace, self._keys(request.keys))
        return m.DeleteReply(request.id, num_deleted)

    def stats_reply(self, request: m.Stats, received_s: float) -> m._Reply:
        """The reply to a stats request received at monotonic `received_s`; on `stats_executor`.

        A snapshot begun after the request arrived is as fresh as one made for it, so requests
        that queued while one was computed share the next: a client flooding stats costs one
        computation per batch, not one per request.
        """
        started = time.perf_counter()
        try:
            if self._stats_snapshot[0] < received_s:
                self._stats_snapshot = (time.monotonic(), self.stats())
        except Exception as exc:  # a bug must not leave the request unanswered
            log.exception("internal error while handling stats")
            return m.Error(request.id, "internal", f"internal error: {type(exc).__name__}: {exc}")
        self._figures.record_latency("stats", started)
        return m.StatsReply(request.id, self._stats_snapshot[1])

    def _check(self, session: Session, request: m.Check) -> m._Reply:
        return m.CheckReply(request.id, self.store.check(request.verify_bytes))

    def stats(self) -> dict[str, Any]:
        """Store figures plus the daemon's (see `ServiceStats.snapshot`): what `kvtier stats`
        shows and the Prometheus metrics (`kvtier.daemon.metrics`) are derived from."""
        # Two len()s, not a set difference: the loop changes both sets while this thread reads.
        return self._figures.snapshot(
            self.store, self._sessions.values(),
            max(0, len(self.jobs_in_flight) - len(self.stats_in_flight)),
            0 if self.lookup_plane is None else self.lookup_plane.total_refused())

    def scrape(self) -> dict[str, Any]:
        """`stats()` for a Prometheus scrape; its own time is recorded as the verb "scrape", so
        what scrapes cost shows in the figures. Call it on `stats_executor`, like `stats_reply`."""
        started = time.perf_counter()
        stats = self.stats()
        self._figures.record_latency("scrape", started)
        return stats

    def close(self) -> None:
        """Finish copies in flight and end every session; retire the lookup plane's indexes."""
        self.executor.shutdown(wait=True)
        self.remote_executor.shutdown(wait=True)
        self.bulk_executor.shutdown(wait=True)
        self.stats_executor.shutdown(wait=True)
        for session in list(self._sessions.values()):
            self.close_session(session)
        if self.lookup_plane is not None:
            self.lookup_plane.close()


_TIER_LABELS: tuple[str, ...] = tuple(tier.label for tier in Tier)


def _labels(tiers: list[Tier | None]) -> list[str | None]:
    """Tier names for the wire; a tuple lookup, not an enum property per key."""
    return [_TIER_LABELS[t] if t is not None else None for t in tiers]
