"""PageStore: the in-process page store over the hbm (when configured), host and disk tiers.

Verbs: `store`, `lookup`, `recall`, `prefetch`, `rotate`, `delete`, `pin` / `unpin`, `stats`,
`check`, `shrink`, `close`; `open_lanes` adds a transfer engine over the host arena.

`PageStore` holds its pieces as fields (`kvtier.store.parts.StoreParts`): placement (the tiers'
metadata) with the planner over it, the movers (every byte move, one route per source and
destination) and the cascade (room in a tier, disk writes). Each of store, recall and rotate is a
small unit over those parts (`storing.Storer`, `recalling.Recaller`, `rotation.Rotator`) that
reads plan -> copy -> commit (-> promote): plan under the store's lock (reserve slots, mark
residencies WRITING or EVICTING, take reader counts), copy without it, commit under it (READY,
free slots). A residency is visible to lookup only when READY, so a key is never served before
its bytes are complete. Eviction cascades hbm -> host -> disk -> dropped; a disk hit is promoted
to host and keeps its disk copy, a host hit on its `hbm.promote_hits`-th hit is promoted to hbm
and keeps its host copy.

Copies between the host arena and an engine pool bound to a transfer engine (`bind_lanes`, as the
daemon does) go through that engine: stores on its d2h lane, recalls on its h2d lane, each batch
as few large copies, both lanes running at once; a failed copy fails exactly its keys. Callers
passing numpy buffers are copied in their own thread. A disk hit into an engine pool crosses into
the pool once (its host copy is made from the rows the read landed in).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from functools import partial
from typing import TypeVar

from kvtier.config import StoreConfig
from kvtier.keys import Namespace, check_keys
from kvtier.pools.page_access import PageAccess, PageBuffers
from kvtier.store.cascade import Cascade
from kvtier.store.filing import PolicyFiler
from kvtier.store.leases import LeaseTable
from kvtier.store.movers import CopyRoutes
from kvtier.store.namespaces import NamespaceRegistry
from kvtier.store.page_table import PageObserver, PageTable
from kvtier.store.pages import Tier, present_prefix
from kvtier.store.parts import StoreParts, recover_disk
from kvtier.store.pinning import Pinning
from kvtier.store.placement import Placement
from kvtier.store.planner import Planner
from kvtier.store.recalling import Recaller
from kvtier.store.remote_link import RemoteLink
from kvtier.store.results import (
    Lease,
    LookupResult,
    RecallResult,
    StoreResult,
    SwapResult,
)
from kvtier.store.rotation import Rotator
from kvtier.store.stats import StoreCounters, StoreStats, TierStats
from kvtier.store.storing import Storer
from kvtier.tiers.build import build_tiers
from kvtier.tiers.remote import RemoteTier
from kvtier.transfer.duplex import Backend, DuplexLanes

__all__ = ["PageBuffers", "PageStore"]

R = TypeVar("R")


class PageStore:
    """Pages of any number of namespaces across a host arena and a disk directory.

    Thread-safe: callers may run verbs from several threads (the daemon runs copies in a pool).

    Args:
        config: capacities, policies, write policy; `StoreConfig()` gives working defaults.
        clock: monotonic seconds, injectable for lease tests.
        transfer_backend: when given, an engine over the host arena under the key
            `transfer_backend.name` (see `open_lanes`).

    Raises:
        StorageError: the arena or the disk directory cannot be created or is in use.
    """

    def __init__(self, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 transfer_backend: Backend | None = None) -> None:
        self.config = config or StoreConfig()
        self._lock = threading.RLock()
        self._table = PageTable()
        self._counters = StoreCounters()
        self._leases = LeaseTable(clock)
        tiers = build_tiers(self.config)
        self.host, self.disk, self.hbm = tiers.host, tiers.disk, tiers.hbm
        self._placement = Placement(self.config, tiers, self._table, self._counters)
        self._planner = Planner(self._placement, self._table, self._counters)
        self._movers = CopyRoutes(self.host, self.hbm, self.disk)
        self._cascade = Cascade(self._placement, self._movers, self._lock, self._counters)
        registry = NamespaceRegistry(self.config, self._lock, self._table, self._placement,
                                     self._cascade)
        self._namespaces = registry.by_fingerprint
        self._parts = StoreParts(self.config, self._lock, self._table, self._counters,
                                 self._leases, self._placement, self._planner, self._movers,
                                 self._cascade, registry)
        self._filer = PolicyFiler(self._parts)
        self._storer = Storer(self._parts, self._filer)
        self._recaller = Recaller(self._parts, self._filer)
        self._rotator = Rotator(self._parts, self._storer, self._recaller)
        self._pinning = Pinning(self._parts)
        self.lanes_by_key = self._movers.lanes_by_key
        # Per engine key, an engine whose arena is the hbm tier: recalls of hbm hits into that
        # engine's pools (device to device on a GPU).
        self.hbm_lanes_by_key = self._movers.hbm_lanes_by_key
        self._closed = False
        self.remote: RemoteTier | None = None
        self._remote_link: RemoteLink | None = None
        if self.disk is not None:
            try:
                recover_disk(self._parts)
            except BaseException:
                self._placement.close()
                raise
        if transfer_backend is not None:
            self.open_lanes(transfer_backend.name, transfer_backend)
        if self.config.remote.enabled and self.config.with_bytes:
            self._open_remote()

    def _open_remote(self) -> None:
        self.remote = RemoteTier(self.config.remote)
        self._remote_link = RemoteLink(self.remote, self._placement.host_view, self.disk,
                                       partial(self.store, remote_write=False))
        self._parts.remote_link = self._remote_link
        if not self._remote_link.sends_on_store:
            self._cascade.on_last_copy = self._remote_link.spill

    def wait_remote_promotions(self, timeout_s: float | None = None) -> None:
        """Block until the pages recent recalls fetched from the remote tier are in host.

        A recall serves remote pages at once and stores them in host afterwards, off its path;
        this waits for those stores (a no-op without a remote tier).
        """
        if self._remote_link is not None:
            self._remote_link.wait_promotions(timeout_s)

    def open_lanes(self, lanes_key: str, backend: Backend) -> DuplexLanes:
        """A transfer engine over the host arena under `lanes_key`, started on first call.

        Pages bound to `lanes_key` (`PoolPageAccess.bind_lanes`) move through it. A second call
        with the same key returns the running engine (and leaves `backend` unused). With an hbm
        tier the engine can reach (host memory for a CPU backend, the same GPU for a CUDA one),
        a second engine over the hbm tier serves that engine's recalls of hbm hits.

        Raises:
            ProtocolError: a metadata-only store has no arena to move pages to.
        """
        with self._lock:
            return self._movers.open_lanes(lanes_key, backend)

    def observe_pages(self, observer: PageObserver | None) -> None:
        """Have `observer` told, under the store's lock, of every page that becomes visible and
        every page that leaves the table (see `kvtier.store.page_table`), starting with a
        `page_ready` for each page visible now. None stops it."""
        with self._lock:
            self._table.observer = observer
            if observer is not None:
                for entry in self._table.values():
                    if entry.best_tier() is not None:
                        observer.page_ready(entry)

    def call_locked(self, call: Callable[[], R]) -> R:
        """`call()` under the store's lock: for an observer's own work on what it observes."""
        with self._lock:
            return call()

    def register(self, namespace: Namespace) -> None:
        """Make `namespace` known (the verbs do it on first use); see
        `NamespaceRegistry.register`."""
        self._parts.namespaces.register(namespace)

    def store(self, namespace: Namespace, keys: Sequence[bytes],
              pages: PageBuffers | PageAccess | None, parent_key: bytes | None = None,
              remote_write: bool = True) -> StoreResult:
        """Copy `pages[i]` into the store under `keys[i]` (see `Storer.store`)."""
        return self._storer.store(namespace, keys, pages, parent_key, remote_write)

    def recall(self, namespace: Namespace, keys: Sequence[bytes],
               out: PageBuffers | PageAccess | None) -> RecallResult:
        """Copy the pages of `keys` into `out[i]`, verified (see `Recaller.recall`)."""
        return self._recaller.recall(namespace, keys, out)

    def prefetch(self, namespace: Namespace, keys: Sequence[bytes],
                 batch_pages: int = 64) -> RecallResult:
        """Promote the disk-resident pages of `keys` into host (see `Recaller.prefetch`)."""
        return self._recaller.prefetch(namespace, keys, batch_pages)

    def rotate(self, namespace: Namespace, out_keys: Sequence[bytes],
               out_pages: PageBuffers | PageAccess, in_keys: Sequence[bytes],
               in_pages: PageBuffers | PageAccess, parent_key: bytes | None = None) -> SwapResult:
        """Swap pages out of an engine pool and others into it (see `Rotator.rotate`)."""
        return self._rotator.rotate(namespace, out_keys, out_pages, in_keys, in_pages,
                                    parent_key)

    def lookup(self, namespace: Namespace, keys: Sequence[bytes],
               remote: bool = True) -> LookupResult:
        """Report the fastest tier of each key and the length of the present prefix.

        Lookups count hits and misses per tier; they do not move pages or change policy order.
        With a remote tier (and `remote`), keys missing locally after the local prefix are
        fetched in one round trip and the leading run of them stored in host before returning
        (see `remote_may_extend`).
        """
        keys = check_keys(keys)
        fingerprint = namespace.fingerprint
        tiers: list[Tier | None] = []
        with self._lock:
            for key in keys:
                entry = self._table.get(fingerprint + key)
                tiers.append(entry.best_tier() if entry is not None else None)
            self._planner.count_lookups(tiers)
        result = LookupResult(present_prefix(tiers), tiers)
        return self.extend_lookup(namespace, keys, result) if remote else result

    def remote_may_extend(self, result: LookupResult) -> bool:
        """Whether the remote tier could lengthen this local lookup's prefix (it is connected
        and the prefix stops short): the daemon then finishes the lookup off its event loop."""
        return (self.remote is not None and self.remote.connected
                and result.num_prefix < len(result.tiers))

    def extend_lookup(self, namespace: Namespace, keys: Sequence[bytes],
                      result: LookupResult) -> LookupResult:
        """Finish a local lookup (`lookup(..., remote=False)`) with the remote tier."""
        if self._remote_link is None or result.num_prefix == len(result.tiers):
            return result
        tiers = list(result.tiers)
        self._remote_link.extend_prefix(namespace, check_keys(keys), tiers)
        return LookupResult(present_prefix(tiers), tiers)

    def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """Remove `keys` from every tier; return how many were present.

        Copies in flight finish first: a slot is freed only when its last reader leaves.
        """
        keys = check_keys(keys)
        with self._lock:
            num_removed, to_drop = self._placement.unlink(namespace.fingerprint, keys)
            self._table.pages_gone_now()
        self._cascade.drop_from_disk(to_drop)
        return num_removed

    def pin(self, namespace: Namespace, keys: Sequence[bytes], ttl_s: float,
            holder_lease_ids: Iterable[int] = (), max_share: float = 1.0) -> Lease:
        """Hold the present `keys` against eviction (see `Pinning.pin`).

        Raises:
            QuotaError: the lease would take the holder past `max_share` of a tier.
        """
        return self._pinning.pin(namespace, keys, ttl_s, holder_lease_ids, max_share)

    def unpin(self, lease_id: int) -> None:
        """Release a lease.

        Raises:
            ProtocolError: the lease expired or was already released.
        """
        self._pinning.unpin(lease_id)

    def live_leases(self, lease_ids: set[int]) -> set[int]:
        """Those of `lease_ids` that are neither released nor expired."""
        return self._pinning.live_leases(lease_ids)

    def stats(self) -> StoreStats:
        """A snapshot of capacities, occupancy, hit counters and traffic."""
        self._parts.expire_leases()
        with self._lock:
            tiers = tuple(
                TierStats(tier.label, slots.capacity_bytes, slots.used_bytes, slots.num_used,
                          **asdict(self._placement.counters_of(tier)))
                for tier, slots in self._placement.slot_allocators()
            )
            counters = StoreCounters(**asdict(self._counters))
            remote = self.remote.stats() if self.remote is not None else None
            return StoreStats(tiers, counters, len(self._leases), len(self._namespaces), remote)

    def check(self, verify_bytes: bool = True) -> list[str]:
        """Walk every page and return a list of problems; empty when the store is sound.

        Checks slot accounting, policy tracking, the disk index against the table, and, with
        `verify_bytes`, every disk page's header and checksum and every host page whose checksum
        is known.
        """
        with self._lock:
            return self._placement.check(verify_bytes)

    def shrink(self) -> int:
        """Give back the room the page table, slot maps and policies kept for
        pages gone (a dict never shrinks by itself: `kvtier.dict_room`); the bytes given back.
        One hold of the lock per table owner, so a request waits for one rebuild at most."""
        steps = [self._table.shrink, *self.call_locked(self._placement.shrink_steps)]
        return sum(self.call_locked(step) for step in steps)

    def flush(self) -> None:
        """Make every disk index update so far durable (the daemon calls it every second)."""
        if self.disk is not None:
            self.disk.sync_index()

    def close(self) -> None:
        """Persist disk access data, close the index and release the arena (idempotent)."""
        if self._remote_link is not None and not self._closed:
            self._remote_link.close()  # its promotions take the lock: finish them first
        self._filer.close()  # so does the policies' bookkeeping of copies under way
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.remote is not None:
                self.remote.close()  # queued writes go out while the arena still exists
            self._movers.close()  # lanes drain before the arenas go away
            self._cascade.demote_at_close()
            self._placement.close()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
