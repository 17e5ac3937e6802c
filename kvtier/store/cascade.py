"""The eviction cascade: making room in a tier, and the disk writes that room and stores need.

`reserve` gives pages WRITING slots in a tier, evicting the victims the tier's policy picks: hbm
victims without a host copy are demoted to host, host victims to disk (as the write policy
says), disk victims dropped, and each demotion may cascade on (hbm -> host -> disk -> dropped).
`write_disk` writes pages durably and makes them READY there; `drop_from_disk` removes disk
copies; `promote` copies a recall's hits up (hot host pages into hbm, verified disk hits into
host); `demote_at_close` writes host-only pages to disk before exit, so a restart finds the
warm cache.

Every step runs as: decide under the store's lock (placement's metadata), move bytes through the
movers without it, commit under it again. These methods take the lock themselves; the
placement methods they call expect it held, the movers never take it.

Verbs: `reserve`, `write_disk`, `drop_from_disk`, `promote`, `demote_at_close`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from kvtier.errors import StorageError
from kvtier.pools.page_access import PageAccess
from kvtier.store.movers import CopyRoutes, Endpoint
from kvtier.store.pages import PageEntry, PageState, Tier
from kvtier.store.placement import Placement, Reservation
from kvtier.store.planner import PromotionPlan
from kvtier.store.stats import StoreCounters
from kvtier.tiers.disk import DiskWrite

log = logging.getLogger(__name__)

# Victims whose last local copy is leaving `tier` (their slots EVICTING, not yet freed).
LastCopyHook = Callable[[Tier, list[PageEntry]], None]


class Cascade:
    """Room in the tiers, made by evicting down the hierarchy, and the disk writes it takes.

    Args:
        placement: the tiers' metadata (slots, policies, states).
        movers: the byte moves between tiers.
        lock: the store's lock, which `placement` expects held.
        counters: the store's counters (promotions, demotions).
    """

    def __init__(self, placement: Placement, movers: CopyRoutes, lock: threading.RLock,
                 counters: StoreCounters) -> None:
        self._placement = placement
        self._movers = movers
        self._lock = lock
        self._counters = counters
        self._with_bytes = placement.config.with_bytes
        self._evictors: dict[Tier, Callable[[list[PageEntry]], None]] = {
            Tier.HBM: self._evict_hbm, Tier.HOST: self._evict_host, Tier.DISK: self._evict_disk}
        # Called with victims of a tier, their slots EVICTING, before those slots are freed:
        # the remote tier's "evict" write mode sends pages whose last local copy is leaving.
        self.on_last_copy: LastCopyHook | None = None

    def reserve(self, tier: Tier, entries: list[PageEntry]) -> Reservation:
        """Give each entry a WRITING slot in `tier`, evicting (and demoting) as needed.

        Entries that already have a residency in `tier` or were deleted are skipped.
        """
        reservation = Reservation([], {})
        pending = entries
        while pending:
            with self._lock:
                waiting = self._placement.alloc_slots(tier, pending, reservation.reserved)
                if not waiting:
                    return reservation
                victims = self._placement.choose_victims(tier, waiting)
                if not victims:
                    problem = (f"{tier.label} tier is full: every page in it is pinned, "
                               f"being read or being written")
                    reservation.failed.update((entry.key, problem) for entry in waiting)
                    return reservation
            self._evict(tier, victims)
            pending = waiting
        return reservation

    def _evict(self, tier: Tier, victims: list[PageEntry]) -> None:
        """Move victims out of `tier`: demote hbm and host pages, drop disk pages.

        The victims' slots are freed whatever happens: a failed demotion drops the page.
        """
        try:
            self._evictors[tier](victims)
        finally:
            with self._lock:
                self._placement.release_victims(tier, victims)

    def _evict_hbm(self, victims: list[PageEntry]) -> None:
        """Copy hbm victims that have no host copy down into host (which may evict to disk).

        A victim whose demotion finds no host room is dropped from hbm all the same.
        """
        homeless = [v for v in victims if v.host is None and not v.deleted]
        if not homeless:
            return
        reserved = self.reserve(Tier.HOST, homeless).reserved
        if self._with_bytes:
            self._movers.move(Tier.HBM, Tier.HOST, reserved)
        with self._lock:
            self._placement.make_ready(Tier.HOST, reserved)
            self._counters.demotions += len(reserved)

    def _evict_host(self, victims: list[PageEntry]) -> None:
        """Demote the host victims the write policy keeps to disk; spill last copies."""
        demote = [v for v in victims if self._placement.should_demote(v)]
        if demote:
            failed = self.write_disk([(v, self._placement.host_bytes(v)) for v in demote])
            self._counters.demotions += len(demote) - len(failed)
            self._counters.demotion_failures += len(failed)
        if self.on_last_copy is not None:
            self.on_last_copy(Tier.HOST, victims)

    def _evict_disk(self, victims: list[PageEntry]) -> None:
        """Drop disk victims from the index (spilling last copies first)."""
        disk = self._placement.disk
        assert disk is not None
        if self.on_last_copy is not None:
            self.on_last_copy(Tier.DISK, victims)
        disk.remove([(v.scoped_key, v.disk.slot) for v in victims if v.disk is not None])

    def write_disk(self, pages: list[tuple[PageEntry, np.ndarray | None]],
                   overlap: Callable[[], None] | None = None,
                   before_run: Callable[[list[DiskWrite]], None] | None = None) -> dict[bytes, str]:
        """Write `pages` durably to disk and make them READY there. Returns {key: problem}.

        `overlap()` runs once, in this thread, while the disk writes are in flight;
        `before_run(run)` before each run of them is written (`DiskTier.write_pages`).
        """
        if self._placement.disk is None or not pages:
            if overlap is not None:
                overlap()
            return {}
        with self._lock:
            admitted, failed = self._placement.admit_to_disk(pages)
        reservation = self.reserve(Tier.DISK, [entry for entry, _ in admitted])
        failed.update(reservation.failed)
        writes = [DiskWrite(entry.scoped_key, entry.disk.slot, source, entry.checksum)
                  for entry, source in admitted if entry.disk is not None
                  and entry.disk.state is PageState.WRITING]
        try:
            self._movers.write_disk(writes, overlap, before_run)
        except BaseException as exc:
            with self._lock:
                for entry in reservation.reserved:
                    failed[entry.key] = str(exc)
                self._placement.release_writing(Tier.DISK, reservation.reserved)
            if not isinstance(exc, StorageError):
                raise
            log.error("disk write of %d pages failed: %s", len(writes), exc)
            return failed
        checksum_by_key = {write.scoped_key: write.checksum for write in writes}
        with self._lock:
            doomed = self._placement.commit_disk_writes(reservation.reserved, checksum_by_key)
        self.drop_from_disk(doomed)
        return failed

    def drop_from_disk(self, entries: list[PageEntry]) -> None:
        """Remove disk copies the caller marked EVICTING: index first, then slots.

        Only the caller that moved a residency to EVICTING may drop it: a WRITING residency
        belongs to its writer, another EVICTING one to its evictor.
        """
        disk = self._placement.disk
        if not entries or disk is None:
            return
        disk.remove([(entry.scoped_key, entry.disk.slot) for entry in entries
                     if entry.disk is not None])
        with self._lock:
            self._placement.forget_dropped(entries)

    def promote(self, plan: PromotionPlan, rows: PageAccess | None,
                deliver_landed: bool = False) -> set[int]:
        """Copy a recall's hits up, their sources read-held by the caller: hot host pages into
        hbm (making room may demote hbm pages to host), then verified disk hits into host from
        the rows they landed in (`rows.row(index)`: an engine pool's pages are not read back out
        of it). A copy that fails leaves its page where it was.

        With `deliver_landed` (the disk hits were not landed in `rows`' pages yet, which ride
        running lanes), each disk hit copied up goes on into its page from its new host slot, on
        the h2d lane with the host hits' kind of batching. Returns the request indices so
        delivered; the caller lands the others.
        """
        self._promote_to_hbm(plan.to_hbm)
        return self._promote_to_host(plan.to_host, rows, deliver_landed)

    def _promote_to_hbm(self, entries: list[PageEntry]) -> None:
        """Copy hot host pages into hbm slots, keeping their host copies."""
        if not entries:
            return
        reserved = self.reserve(Tier.HBM, entries).reserved
        if self._with_bytes:
            self._movers.move(Tier.HOST, Tier.HBM, reserved)
        with self._lock:
            self._counters.promotions += self._placement.make_ready(Tier.HBM, reserved)

    def _promote_to_host(self, pages: list[tuple[PageEntry, int]], rows: PageAccess | None,
                         deliver: bool) -> set[int]:
        """Copy verified disk hits into host slots from the request rows they landed in,
        keeping their disk copies; with `deliver`, on into the request's pages from the slots
        (still reserved: no one can evict them meanwhile). Returns the indices delivered."""
        if not pages:
            return set()
        reserved = self.reserve(Tier.HOST, [entry for entry, _ in pages]).reserved
        delivered: set[int] = set()
        if rows is not None:
            index_by_entry = {id(entry): index for entry, index in pages}
            indexed = [(e, index_by_entry[id(e)]) for e in reserved]
            try:
                self._movers.copy(Endpoint.LANDED, Tier.HOST, indexed, rows)
                if deliver:
                    failed = self._movers.copy(Tier.HOST, Endpoint.PAGES, indexed, rows)
                    delivered = {index for e, index in indexed if e.key not in failed}
            except BaseException:
                with self._lock:
                    self._placement.release_writing(Tier.HOST, reserved)
                raise
        with self._lock:
            self._counters.promotions += self._placement.make_ready(Tier.HOST, reserved)
        return delivered

    def demote_at_close(self, batch_pages: int = 64) -> None:
        """Write host-only pages to disk before exit, so a restart finds the warm cache.

        Under write-back (or selective) a page reaches disk only when evicted; a clean shutdown
        is the last eviction of every page.
        """
        if self._placement.disk is None or not self._with_bytes:
            return
        with self._lock:
            pending = self._placement.pending_demotions()
        if not pending:
            return
        log.info("writing %d host pages to disk before exit", len(pending))
        failed = 0
        for start in range(0, len(pending), batch_pages):
            batch = pending[start : start + batch_pages]
            failed += len(self.write_disk([(e, self._movers.readable_bytes(e)) for e in batch]))
        if failed:
            log.warning("%d host pages could not be written to disk at exit", failed)
