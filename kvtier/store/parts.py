"""What every verb of the page store works on, built once by `PageStore` and handed to each verb.

`StoreParts` holds the store's lock, the page table, the counters, the leases, and the three
pieces the verbs drive: `placement` (metadata: slots, policies, states) with `planner` (the verbs'
plans over it), `movers` (every byte move, one route per source and destination) and `cascade`
(room in a tier, disk writes). Each verb (`kvtier.store.storing`, `recalling`, `rotation`) reads
plan under the lock -> copy without it -> commit under it, through these fields. Also here:
`page_rows` (a request's buffers as rows) and `recover_disk` (the disk's pages at start).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.config import StoreConfig
from kvtier.errors import ProtocolError
from kvtier.keys import Namespace
from kvtier.pools.page_access import PageAccess, PageBuffers, PageRows
from kvtier.store.cascade import Cascade
from kvtier.store.leases import LeaseTable
from kvtier.store.movers import CopyRoutes
from kvtier.store.namespaces import NamespaceRegistry
from kvtier.store.page_table import PageTable
from kvtier.store.pages import PageEntry, PageState, Residency, Tier
from kvtier.store.placement import Placement
from kvtier.store.planner import Planner
from kvtier.store.remote_link import RemoteLink
from kvtier.store.stats import StoreCounters

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreParts:
    """The state and the pieces the verbs share (see the module docstring)."""

    config: StoreConfig
    lock: threading.RLock
    table: PageTable
    counters: StoreCounters
    leases: LeaseTable
    placement: Placement
    planner: Planner
    movers: CopyRoutes
    cascade: Cascade
    namespaces: NamespaceRegistry
    remote_link: RemoteLink | None = None  # set once the remote tier is connected

    def expire_leases(self) -> None:
        """Drop the pins of every lease past its expiry."""
        with self.lock:
            for entries in self.leases.pop_expired():
                for entry in entries:
                    entry.pins -= 1

    def page_rows(self, namespace: Namespace, pages: PageBuffers | PageAccess | None,
                  num_keys: int, writable: bool = False) -> PageAccess | None:
        """The caller's buffers as `PageRows`; None in metadata-only mode, where there are none.

        Raises:
            ProtocolError: buffers passed to a metadata-only store, none to one with bytes, or
                buffers that do not match the keys or the page size.
        """
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


def recover_disk(parts: StoreParts) -> None:
    """Put the disk tier's pages of a previous run into the table, oldest access first, and
    forget the persisted namespaces none of whose pages survived."""
    disk = parts.placement.disk
    assert disk is not None
    known = parts.namespaces.by_fingerprint
    for namespace in disk.namespaces():
        known[namespace.fingerprint] = namespace
    page_bytes = {fp: ns.page_bytes for fp, ns in known.items()}
    records = sorted(disk.recover(page_bytes), key=lambda r: r.last_access_s)
    # A namespace none of whose pages survived holds nothing: forget it, so the index
    # does not keep (and every start load) namespaces nobody uses.
    in_use = {record.scoped_key[:16] for record in records}
    empty = [fp for fp in known if fp not in in_use]
    for fingerprint in empty:
        del known[fingerprint]
    if empty:
        disk.forget_namespaces(empty)
    for record in records:
        entry = PageEntry(record.scoped_key, known[record.scoped_key[:16]],
                          disk=Residency(record.slot, PageState.READY),
                          checksum=record.checksum, hits=record.hits,
                          last_access_s=record.last_access_s)
        parts.table[record.scoped_key] = entry
        parts.placement.adopt(entry, Tier.DISK)
        parts.placement.track_ready(entry, Tier.DISK)
    if records:
        log.info("disk tier %s: recovered %d pages", disk.path, len(records))
