"""The namespaces a page store knows, and the room it makes when it knows `max_namespaces`.

`register` makes a namespace known on first use and persists it on disk. When the store is full,
it first forgets namespaces that hold no pages, then deletes the pages of the namespace used
longest ago (skipping those with pinned pages), so a full table admits a new model instead of
refusing every one after it. `relearn` puts back, before a verb plans its pages, a namespace
another registration forgot since this verb's `register`. Verbs: `register`, `relearn`, `persist`.
"""

from __future__ import annotations

import logging
import threading

from kvtier.config import StoreConfig
from kvtier.errors import CapacityError, ProtocolError
from kvtier.keys import Namespace
from kvtier.store.cascade import Cascade
from kvtier.store.page_table import PageTable
from kvtier.store.pages import PageEntry
from kvtier.store.placement import Placement

log = logging.getLogger(__name__)


class NamespaceRegistry:
    """Namespaces by fingerprint (`by_fingerprint`), bounded by `config.max_namespaces`."""

    def __init__(self, config: StoreConfig, lock: threading.RLock, table: PageTable,
                 placement: Placement, cascade: Cascade) -> None:
        self.by_fingerprint: dict[bytes, Namespace] = {}
        self._config = config
        self._lock = lock
        self._table = table
        self._placement = placement
        self._cascade = cascade

    def register(self, namespace: Namespace) -> None:
        """Make `namespace` known (the verbs do it on first use); persists it on disk.

        Raises:
            ProtocolError: its model id or layout name is longer than `max_model_id_bytes`.
            CapacityError: a page of this namespace does not fit a tier's chunk, or the store
                knows `max_namespaces` namespaces and every one of them holds pages.
        """
        if namespace.fingerprint in self.by_fingerprint:
            return
        limit = self._config.max_model_id_bytes
        for name in ("model_id", "layout"):
            num_bytes = len(getattr(namespace, name).encode())
            if num_bytes > limit:
                raise ProtocolError(f"namespace {name} is {num_bytes} bytes; the limit is {limit} "
                                    f"(setting store.max_model_id_bytes)")
        self._placement.check_fits(namespace)
        max_namespaces = self._config.max_namespaces
        with self._lock:
            to_drop: list[PageEntry] = []
            if len(self.by_fingerprint) >= max_namespaces:
                self._forget_empty()
            if len(self.by_fingerprint) >= max_namespaces:
                to_drop = self._evict_coldest()
                self._forget_empty()
            if len(self.by_fingerprint) >= max_namespaces:
                raise CapacityError(
                    f"the store knows {len(self.by_fingerprint)} namespaces, each holding pinned "
                    f"pages (setting store.max_namespaces); unpin or delete pages of models no "
                    f"longer served, or raise the setting")
            self.by_fingerprint[namespace.fingerprint] = namespace
        self._cascade.drop_from_disk(to_drop)
        self.persist(namespace)

    def relearn(self, namespace: Namespace) -> bool:
        """Under the lock, in the same hold as the plan of pages of `namespace`: put it back if
        another registration forgot it since this verb's `register` (it had no pages then).
        True when put back: the caller then `persist`s it before any page of it reaches disk."""
        if namespace.fingerprint in self.by_fingerprint:
            return False
        self.by_fingerprint[namespace.fingerprint] = namespace
        return True

    def persist(self, namespace: Namespace) -> None:
        """Write `namespace` to the disk tier's index (without the lock; no-op without a disk)."""
        if self._placement.disk is not None:
            self._placement.disk.remember_namespace(namespace)

    def _forget_empty(self) -> None:
        """Forget every namespace no page belongs to (in any tier); called under the lock, when
        full. Their pools keep working: a store re-registers its namespace."""
        in_use = {scoped_key[:16] for scoped_key in self._table}
        empty = [ns for fp, ns in self.by_fingerprint.items() if fp not in in_use]
        for namespace in empty:
            del self.by_fingerprint[namespace.fingerprint]
        disk = self._placement.disk
        if empty and disk is not None:
            disk.forget_namespaces([ns.fingerprint for ns in empty])
        if empty:
            log.info("forgot %d namespaces that held no pages (store.max_namespaces is %d)",
                     len(empty), self._config.max_namespaces)

    def _evict_coldest(self) -> list[PageEntry]:
        """Under the lock, with every known namespace holding pages: delete the pages of the one
        used longest ago (by its most recent page access), skipping those with pinned pages
        (namespaces filled by one client that left would otherwise lock the node out). Returns
        the entries whose disk copies the caller drops, outside the lock."""
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
                    "used longest ago (%s) to admit a new one", self._config.max_namespaces,
                    num_removed, self.by_fingerprint[coldest].model_id[:80])
        return to_drop
