"""The page store's state and what every verb shares: tiers, the page table, namespaces, leases.

`StoreCore` builds the tiers (through `Placement`), the movers and the eviction cascade, recovers
the disk tier's pages, and knows the namespaces (`register`, forgetting those that hold no pages
when the store knows `max_namespaces`, then the pages of the namespace used longest ago). The verbs build on it: `kvtier.store.storing` (store),
`kvtier.store.recalling` (recall, prefetch), `kvtier.store.rotation` (rotate) and
`kvtier.store.page_store` (`PageStore`: the rest, and the public class).

Every verb runs in three steps so bytes never move under the store's lock: plan under the lock
(placement: reserve slots, mark residencies WRITING or EVICTING, take reader counts), copy
without it (the movers), then commit under it (READY, free slots).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from kvtier.config import StoreConfig
from kvtier.errors import CapacityError, ProtocolError
from kvtier.keys import Namespace
from kvtier.store.cascade import Cascade
from kvtier.store.leases import LeaseTable
from kvtier.store.movers import CopyRoutes
from kvtier.store.page_table import PageObserver, PageTable
from kvtier.store.pages import PageEntry, PageState, Residency, Tier
from kvtier.store.planner import Planner
from kvtier.store.remote_link import RemoteLink
from kvtier.store.stats import StoreCounters
from kvtier.tiers.build import build_tiers
from kvtier.tiers.page_rows import PageAccess, PageBuffers, PageRows
from kvtier.tiers.remote import RemoteTier

R = TypeVar("R")
log = logging.getLogger(__name__)



class StoreCore:
    """The state every verb of `PageStore` works on (see `PageStore` for the arguments)."""

    def __init__(self, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or StoreConfig()
        self._lock = threading.RLock()
        self._table = PageTable()
        self._namespaces: dict[bytes, Namespace] = {}
        self._leases = LeaseTable(clock)
        self._counters = StoreCounters()
        self._placement = Planner(self.config, build_tiers(self.config), self._table,
                                  self._counters)
        self.host = self._placement.host
        self.disk = self._placement.disk
        self.hbm = self._placement.hbm
        self._movers = CopyRoutes(self.host, self.hbm, self.disk)
        self._cascade = Cascade(self._placement, self._movers, self._lock, self._counters)
        self.lanes_by_key = self._movers.lanes_by_key
        # Per engine key, an engine whose arena is the hbm tier: recalls of hbm hits into that
        # engine's pools (device to device on a GPU).
        self.hbm_lanes_by_key = self._movers.hbm_lanes_by_key
        self._closed = False
        self.remote: RemoteTier | None = None
        self._remote_link: RemoteLink | None = None
        if self.disk is not None:
            try:
                self._recover_disk()
            except BaseException:
                self._placement.close()
                raise

    def _recover_disk(self) -> None:
        assert self.disk is not None
        for namespace in self.disk.namespaces():
            self._namespaces[namespace.fingerprint] = namespace
        page_bytes = {fp: ns.page_bytes for fp, ns in self._namespaces.items()}
        records = sorted(self.disk.recover(page_bytes), key=lambda r: r.last_access_s)
        # A namespace none of whose pages survived holds nothing: forget it, so the index
        # does not keep (and every start load) namespaces nobody uses.
        in_use = {record.scoped_key[:16] for record in records}
        empty = [fp for fp in self._namespaces if fp not in in_use]
        for fingerprint in empty:
            del self._namespaces[fingerprint]
        if empty:
            self.disk.forget_namespaces(empty)
        for record in records:
            entry = PageEntry(record.scoped_key, self._namespaces[record.scoped_key[:16]],
                              disk=Residency(record.slot, PageState.READY),
                              checksum=record.checksum, hits=record.hits,
                              last_access_s=record.last_access_s)
            self._table[record.scoped_key] = entry
            self._placement.track_ready(entry, Tier.DISK)
        if records:
            log.info("disk tier %s: recovered %d pages", self.disk.path, len(records))

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
        """Make `namespace` known (the verbs do it on first use); persists it on disk.

        Raises:
            ProtocolError: its model id or layout name is longer than `max_model_id_bytes`.
            CapacityError: a page of this namespace does not fit a tier's chunk, or the store
                knows `max_namespaces` namespaces and every one of them holds pages.
        """
        if namespace.fingerprint in self._namespaces:
            return
        limit = self.config.max_model_id_bytes
        for name in ("model_id", "layout"):
            num_bytes = len(getattr(namespace, name).encode())
            if num_bytes > limit:
                raise ProtocolError(f"namespace {name} is {num_bytes} bytes; the limit is {limit} "
                                    f"(setting store.max_model_id_bytes)")
        self._placement.check_fits(namespace)
        with self._lock:
            to_drop: list[PageEntry] = []
            if len(self._namespaces) >= self.config.max_namespaces:
                self._forget_empty_namespaces()
            if len(self._namespaces) >= self.config.max_namespaces:
                to_drop = self._evict_coldest_namespace()
                self._forget_empty_namespaces()
            if len(self._namespaces) >= self.config.max_namespaces:
                raise CapacityError(
                    f"the store knows {len(self._namespaces)} namespaces, each holding pinned "
                    f"pages (setting store.max_namespaces); unpin or delete pages of models no "
                    f"longer served, or raise the setting")
            self._namespaces[namespace.fingerprint] = namespace
        self._cascade.drop_from_disk(to_drop)
        if self.disk is not None:
            self.disk.remember_namespace(namespace)

    def _relearn(self, namespace: Namespace) -> bool:
        """Under the lock, before pages of `namespace` are planned: put it back if another
        registration forgot it since this verb's `register` (it had no pages then). True when
        put back: the caller persists it before any page of it reaches the disk."""
        if namespace.fingerprint in self._namespaces:
            return False
        self._namespaces[namespace.fingerprint] = namespace
        return True

    def _forget_empty_namespaces(self) -> None:
        """Forget every namespace no page belongs to (in any tier); called under the lock, when
        full. Their pools keep working: a store re-registers its namespace."""
        in_use = {scoped_key[:16] for scoped_key in self._table}
        empty = [ns for fp, ns in self._namespaces.items() if fp not in in_use]
        for namespace in empty:
            del self._namespaces[namespace.fingerprint]
        if empty and self.disk is not None:
            self.disk.forget_namespaces([ns.fingerprint for ns in empty])
        if empty:
            log.info("forgot %d namespaces that held no pages (store.max_namespaces is %d)",
                     len(empty), self.config.max_namespaces)

    def _evict_coldest_namespace(self) -> list[PageEntry]:
        """Under the lock, with every known namespace holding pages: delete the pages of the one
        used longest ago (by its most recent page access), skipping those with pinned pages, so
        a full table admits a new model instead of refusing every one after it (namespaces
        filled by one client that left would otherwise lock the node out). Returns the entries
        whose disk copies the caller drops, outside the lock."""
        newest_access_s: dict[bytes, float] = {}
        pinned: set[bytes] = set()
        keys_by_namespace: dict[bytes, list[bytes]] = {}
        for scoped_key, entry in self._table.items():
            fingerprint = scoped_key[:16]
            keys_by_namespace.setdefault(fingerprint, []).append(scoped_key[16:])
            if entry.pins:
                pinned.add(fingerprint)
            if entry.last_access_s >= newest_access_s.get(fingerprint, float("-inf")):
                newest_access_s[fingerprint] = entry.last_access_s
        candidates = [fp for fp in newest_access_s if fp not in pinned]
        if not candidates:
            return []
        coldest = min(candidates, key=newest_access_s.__getitem__)
        num_removed, to_drop = self._placement.unlink(coldest, keys_by_namespace[coldest])
        log.warning("store.max_namespaces (%d) reached: evicted the %d pages of the namespace "
                    "used longest ago (%s) to admit a new one", self.config.max_namespaces,
                    num_removed, self._namespaces[coldest].model_id[:80])
        return to_drop

    def _expire_leases(self) -> None:
        with self._lock:
            for entries in self._leases.pop_expired():
                for entry in entries:
                    entry.pins -= 1

    def _page_rows(self, namespace: Namespace, pages: PageBuffers | PageAccess | None,
                   num_keys: int, writable: bool = False) -> PageAccess | None:
        """The caller's buffers as `PageRows`; None in metadata-only mode, where there are none."""
        if not self.config.with_bytes:
            if pages is not None:
                raise ProtocolError("this store is metadata-only: pass None instead of buffers")
            return None
        if pages is None:
            raise ProtocolError("page buffers are required (only a metadata-only store takes None)")
        if not isinstance(pages, (np.ndarray, Sequence)):  # a PageAccess, e.g. a pool's pages
            if pages.num_pages != num_keys or pages.page_bytes != namespace.page_bytes:
                raise ProtocolError(f"{num_keys} keys of {namespace.page_bytes}-byte pages but "
                                    f"{pages.num_pages} pool pages of {pages.page_bytes} bytes")
            return pages
        return PageRows.from_buffers(pages, num_keys, namespace.page_bytes, writable)

