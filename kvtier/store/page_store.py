"""PageStore: the in-process page store over the hbm (when configured), host and disk tiers.

Verbs: `store`, `lookup`, `recall`, `rotate`, `delete`, `pin` / `unpin`, `stats`, `check`,
`close`; `open_engine` adds a transfer engine over the host arena.

Every verb runs in three steps so bytes never move under the store's lock: plan under the lock
(reserve slots, mark residencies WRITING or EVICTING, take reader counts), copy without it, then
commit under it (READY, free slots). A residency is visible to lookup only when READY, so a key is
never served before its bytes are complete. Eviction cascades hbm -> host -> disk -> dropped; a
disk hit is promoted to host and keeps its disk copy, a host hit on its `hbm.promote_hits`-th
hit is promoted to hbm and keeps its host copy.

Copies between the host arena and an engine pool bound to a transfer engine (`bind_lanes`, as the
daemon does) go through that engine: stores on its d2h lane, recalls on its h2d lane, each batch
as few large copies, both lanes running at once; a failed copy fails exactly its keys. Callers
passing numpy buffers are copied in their own thread, as before.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import numpy as np

from kvtier.config import StoreConfig, WritePolicy
from kvtier.errors import CapacityError, ProtocolError
from kvtier.keys import Namespace, check_keys
from kvtier.store.leases import LeaseTable
from kvtier.tiers.page_rows import LaneBinding, PageAccess, PageRows
from kvtier.store.pages import PageEntry, PageState, Residency, Tier, present_prefix
from kvtier.store.cascade import Cascade
from kvtier.store.movers import Endpoint, Movers, wait_job
from kvtier.store.placement import Placement
from kvtier.store.remote_link import RemoteLink
from kvtier.store.results import Lease, LookupResult, RecallResult, RotateResult, StoreResult
from kvtier.store.stats import StoreCounters, StoreStats, TierStats
from kvtier.tiers.remote import RemoteTier
from kvtier.transfer.engine import Backend, TransferEngine

log = logging.getLogger(__name__)

PageBuffers = np.ndarray | Sequence[np.ndarray | memoryview | bytes]


class PageStore:
    """Pages of any number of namespaces across a host arena and a disk directory.

    Thread-safe: callers may run verbs from several threads (the daemon runs copies in a pool).

    Args:
        config: capacities, policies, write policy; `StoreConfig()` gives working defaults.
        clock: monotonic seconds, injectable for lease tests.
        transfer_backend: when given, an engine over the host arena under the key
            `transfer_backend.name` (see `open_engine`).

    Raises:
        StorageError: the arena or the disk directory cannot be created or is in use.
    """

    def __init__(self, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 transfer_backend: Backend | None = None) -> None:
        self.config = config or StoreConfig()
        self._lock = threading.RLock()
        self._table: dict[bytes, PageEntry] = {}
        self._namespaces: dict[bytes, Namespace] = {}
        self._leases = LeaseTable(clock)
        self._counters = StoreCounters()
        self._placement = Placement(self.config, self._table, self._counters)
        self.host = self._placement.host
        self.disk = self._placement.disk
        self.hbm = self._placement.hbm
        self._movers = Movers(self.host, self.hbm, self.disk)
        self._cascade = Cascade(self._placement, self._movers, self._lock, self._counters)
        self.engines = self._movers.engines
        # Per engine key, an engine whose arena is the hbm tier: recalls of hbm hits into that
        # engine's pools (device to device on a GPU).
        self.hbm_engines = self._movers.hbm_engines
        self._closed = False
        self.remote: RemoteTier | None = None
        self._remote_link: RemoteLink | None = None
        if self.disk is not None:
            try:
                self._recover_disk()
            except BaseException:
                self._placement.close()
                raise
        if transfer_backend is not None:
            self.open_engine(transfer_backend.name, transfer_backend)
        if self.config.remote.enabled and self.config.with_bytes:
            self._open_remote()

    def _open_remote(self) -> None:
        self.remote = RemoteTier(self.config.remote)
        self._remote_link = RemoteLink(self.remote, self._placement.host_bytes, self.disk,
                                       partial(self.store, remote_write=False))
        if not self._remote_link.sends_on_store:
            self._cascade.on_last_copy = self._remote_link.spill

    def wait_remote_promotions(self, timeout_s: float | None = None) -> None:
        """Block until the pages recent recalls fetched from the remote tier are in host.

        A recall serves remote pages at once and stores them in host afterwards, off its path;
        this waits for those stores (a no-op without a remote tier).
        """
        if self._remote_link is not None:
            self._remote_link.wait_promotions(timeout_s)

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

    def open_engine(self, engine_key: str, backend: Backend) -> TransferEngine:
        """A transfer engine over the host arena under `engine_key`, started on first call.

        Pages bound to `engine_key` (`StagedPages.bind_lanes`) move through it. A second call
        with the same key returns the running engine (and leaves `backend` unused). With an hbm
        tier the engine can reach (host memory for a CPU backend, the same GPU for a CUDA one),
        a second engine over the hbm tier serves that engine's recalls of hbm hits.

        Raises:
            ProtocolError: a metadata-only store has no arena to move pages to.
        """
        with self._lock:
            return self._movers.open_engine(engine_key, backend)

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
            if len(self._namespaces) >= self.config.max_namespaces:
                self._forget_empty_namespaces()
            if len(self._namespaces) >= self.config.max_namespaces:
                raise CapacityError(
                    f"the store knows {len(self._namespaces)} namespaces, each holding pages "
                    f"(setting store.max_namespaces); delete pages of models no longer served, "
                    f"or raise the setting")
            self._namespaces[namespace.fingerprint] = namespace
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

    def store(self, namespace: Namespace, keys: Sequence[bytes], pages: PageBuffers | None,
              parent_key: bytes | None = None, remote_write: bool = True) -> StoreResult:
        """Copy `pages[i]` into the store under `keys[i]`.

        `keys` are taken as one prefix chain (key i-1 is the parent of key i, `parent_key` the
        parent of key 0), which prefix-aware policies use. With write-through, a key is reported stored only once it is durable on disk.
        In metadata-only mode (`StoreConfig(with_bytes=False)`) `pages` is None. With a remote
        tier in write mode "through", stored pages are also queued for it unless `remote_write`
        is False (pages that came from it).

        Raises:
            ProtocolError: bad keys, or pages that do not match the keys or the page size.
        """
        keys = check_keys(keys)
        sources = self._page_rows(namespace, pages, len(keys))
        self.register(namespace)
        self._expire_leases()
        with self._lock:
            relearned = self._relearn(namespace)
            plan = self._placement.plan_store(namespace, keys, parent_key)
        if relearned and self.disk is not None:
            self.disk.remember_namespace(namespace)
        failed = dict(plan.failed)
        through = self.config.write_policy is WritePolicy.WRITE_THROUGH
        stored: list[bytes] = []
        waiting = plan.to_host_indexed
        to_disk = plan.to_disk_indexed
        while True:
            # A run larger than what the host can free: with a disk, its first pages stay in
            # host and the rest go straight to disk (the prefix stays whole, in the fastest
            # tier, and no page is copied twice). Without one, in waves: pages stored by one
            # wave become evictable (spilled to a remote tier, or dropped), so it completes.
            reservation = self._cascade.reserve(Tier.HOST, [e for e, _ in waiting])
            if len(reservation.reserved) == len(waiting):
                wave, waiting = waiting, []
            else:  # these entries are this call's own, so a host residency means reserved here
                wave = [(e, i) for e, i in waiting if e.host is not None]
                waiting = [(e, i) for e, i in waiting if e.host is None]
                if self.disk is not None:
                    to_disk, waiting = to_disk + waiting, []
            given_up = []
            if waiting and not wave:  # no progress: nothing left in host may be evicted
                failed.update(reservation.failed)
                given_up, waiting = waiting, []
            copy_wave = None
            copy_failed: dict[bytes, str] = {}
            if sources is not None:
                copy_wave = partial(_copy_into, copy_failed, self._movers.copy, Endpoint.PAGES,
                                    Tier.HOST, wave, sources)
            # In key order: a run's pages get adjacent slots, read back in one system call.
            disk_bound = sorted(to_disk + (wave if through else []), key=lambda pair: pair[1])
            # The host copy runs while the disk writes of a write-through store are in flight.
            failed.update(self._cascade.write_disk(
                [(e, sources.row(i) if sources else None) for e, i in disk_bound], copy_wave))
            failed.update(copy_failed)
            with self._lock:
                committed, to_drop = self._placement.commit_store(wave + to_disk + given_up,
                                                                  failed)
            stored += committed
            self._cascade.drop_from_disk(to_drop)
            to_disk = []
            if not waiting:
                break
        self._counters.pages_stored += len(stored)
        self._counters.bytes_stored += len(stored) * namespace.page_bytes
        link = self._remote_link
        if link is not None and remote_write and link.sends_on_store and sources is not None:
            link.send_stored(namespace, keys, stored, sources)
        return StoreResult(stored, plan.already_present, failed)

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
            self._placement.count_lookups(tiers)
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

    def recall(self, namespace: Namespace, keys: Sequence[bytes],
               out: PageBuffers | None) -> RecallResult:
        """Copy the pages of `keys` into `out[i]`; a disk hit is verified, then promoted to host.

        `out[i]` is written only when key i is in the result's `recalled`; nothing corrupt or
        partial is ever copied into it. In metadata-only mode `out` is None.

        Raises:
            ProtocolError: bad keys, or `out` does not match the keys or the page size.
        """
        keys = check_keys(keys)
        outs = self._page_rows(namespace, out, len(keys), writable=True)
        self._expire_leases()
        with self._lock:
            plan = self._placement.plan_recall(namespace, keys)
        failed: dict[bytes, str] = {}
        copy_failed: dict[bytes, str] = {}
        try:
            if outs is not None:
                copy_failed.update(self._movers.copy(Tier.HBM, Endpoint.PAGES, plan.from_hbm,
                                                     outs))
                copy_failed.update(self._movers.copy(Tier.HOST, Endpoint.PAGES, plan.from_host,
                                                     outs))
            if self.hbm is not None and plan.from_host:  # host copies stay read-held meanwhile
                with self._lock:
                    hot = self._placement.plan_hbm_promotion(
                        [e for e, _ in plan.from_host if e.key not in copy_failed])
                self._cascade.promote_to_hbm(hot)
            if outs is not None:  # verified into the landing rows, then into the pages
                failed = self._movers.copy(Tier.DISK, Endpoint.PAGES, plan.from_disk, outs)
        finally:
            with self._lock:
                to_drop = self._placement.finish_recall(plan, failed)
            self._cascade.drop_from_disk(to_drop)
        self._promote([(e, i) for e, i in plan.from_disk if e.key not in failed], outs)
        tiers: list[Tier | None] = [None] * len(keys)
        for entry, index in plan.from_hbm:
            if entry.key not in copy_failed:
                tiers[index] = Tier.HBM
        for entry, index in plan.from_host:
            if entry.key not in copy_failed:
                tiers[index] = Tier.HOST
        failed.update(copy_failed)
        for entry, index in plan.from_disk:
            if entry.key not in failed:
                tiers[index] = Tier.DISK
        missing = plan.missing
        if missing and self._remote_link is not None and outs is not None:
            missing = self._recall_remote(namespace, keys, tiers, outs)
        recalled = [keys[i] for i, tier in enumerate(tiers) if tier is not None]
        self._counters.pages_recalled += len(recalled)
        self._counters.bytes_recalled += len(recalled) * namespace.page_bytes
        return RecallResult(recalled, tiers, missing, failed)

    def _recall_remote(self, namespace: Namespace, keys: list[bytes], tiers: list[Tier | None],
                       outs: PageAccess) -> list[bytes]:
        """Serve keys missing locally from the remote tier; the keys still missing."""
        indices = [i for i, key in enumerate(keys) if tiers[i] is None]

        def copy_out(found: dict[int, memoryview]) -> None:
            for index, payload in found.items():
                np.copyto(outs.landing_row(index), np.frombuffer(payload, np.uint8))
                tiers[index] = Tier.REMOTE
            outs.land(sorted(found))

        found = self._remote_link.fetch_missing(namespace, keys, indices, list(tiers), copy_out)
        return [keys[i] for i in indices if i not in found]

    def prefetch(self, namespace: Namespace, keys: Sequence[bytes],
                 batch_pages: int = 64) -> RecallResult:
        """Promote the disk-resident pages of `keys` into host, verified, ahead of a recall.

        Keys already in host are left alone; absent keys are reported missing.
        """
        keys = check_keys(keys)
        with self._lock:
            tiers = [self._placement.best_tier(namespace.fingerprint + key) for key in keys]
        if self._remote_link is not None and None in tiers:
            fetched = self._remote_link.fetch_missing(
                namespace, keys, [i for i, tier in enumerate(tiers) if tier is None], list(tiers))
            tiers = [Tier.REMOTE if i in fetched else tier for i, tier in enumerate(tiers)]
        on_disk = [key for key, tier in zip(keys, tiers) if tier is Tier.DISK]
        missing = [key for key, tier in zip(keys, tiers) if tier is None]
        recalled: list[bytes] = []
        failed: dict[bytes, str] = {}
        for start in range(0, len(on_disk), batch_pages):
            batch = on_disk[start : start + batch_pages]
            # The pages pass through a scratch buffer on their way to the host tier.
            scratch = (np.empty((len(batch), namespace.page_bytes), np.uint8)
                       if self.config.with_bytes else None)
            result = self.recall(namespace, batch, scratch)
            recalled += result.recalled
            missing += result.missing
            failed.update(result.failed)
        promoted = set(recalled)
        from_remote = [key for key, tier in zip(keys, tiers) if tier is Tier.REMOTE]
        return RecallResult(recalled + from_remote,
                            [Tier.DISK if k in promoted else tier if tier is Tier.REMOTE else None
                             for k, tier in zip(keys, tiers)], missing, failed)

    def _promote(self, pages: list[tuple[PageEntry, int]], rows: PageAccess | None) -> None:
        """Copy verified disk hits into host slots the host policy admits, from the rows they
        landed in (`rows.row(index)`): an engine pool's pages are not read back out of it."""
        if not pages:
            return
        with self._lock:
            admitted = self._placement.plan_promotion([entry for entry, _ in pages])
        if not admitted:
            return
        reserved = self._cascade.reserve(Tier.HOST, admitted).reserved
        if rows is not None:
            index_by_entry = {id(entry): index for entry, index in pages}
            try:
                self._movers.copy(Endpoint.LANDED, Tier.HOST,
                                  [(e, index_by_entry[id(e)]) for e in reserved], rows)
            except BaseException:  # a promotion that did not copy leaves the page where it was
                with self._lock:
                    self._placement.release_writing(Tier.HOST, reserved)
                raise
        with self._lock:
            self._placement.commit_promotion(reserved)

    def rotate(self, namespace: Namespace, out_keys: Sequence[bytes], out_pages: PageBuffers,
               in_keys: Sequence[bytes], in_pages: PageBuffers,
               parent_key: bytes | None = None) -> RotateResult:
        """Swap pages out of an engine pool and others into it, in one call.

        Stores `out_pages[i]` under `out_keys[i]` (the pages of paused requests) and recalls
        `in_keys[j]` into `in_pages[j]` (resumed ones), possibly into the pool pages just swapped
        out. When both are pages of one pool bound to a transfer engine, the swap-outs run on
        its d2h lane while the host-resident swap-ins run on its h2d lane, and the swap-in into
        a pool page waits only for the swap-out of that same page. A swap-in into a page whose
        swap-out failed is not done (its key is reported failed): that page's bytes are saved
        nowhere. Swap-ins from other tiers follow once the rotation landed. Without an engine,
        this is a store, then a recall.

        Raises:
            ProtocolError: as `store` and `recall`.
        """
        out_keys, in_keys = check_keys(out_keys), check_keys(in_keys)
        sources = self._page_rows(namespace, out_pages, len(out_keys))
        outs = self._page_rows(namespace, in_pages, len(in_keys), writable=True)
        lanes = self._rotation_lanes(sources, outs)
        if lanes is None:
            return RotateResult(self.store(namespace, out_keys, sources, parent_key),
                                self.recall(namespace, in_keys, outs))
        engine, out_binding, in_binding = lanes
        self.register(namespace)
        self._expire_leases()
        with self._lock:  # swap-in sources first: their reader counts keep them from eviction
            recall_plan = self._placement.plan_recall(namespace, in_keys, from_tiers=(Tier.HOST,))
            relearned = self._relearn(namespace)
            store_plan = self._placement.plan_store(namespace, out_keys, parent_key)
        if relearned and self.disk is not None:
            self.disk.remember_namespace(namespace)
        host_bound, disk_bound = store_plan.to_host_indexed, store_plan.to_disk_indexed
        out_failed = dict(store_plan.failed)
        in_failed: dict[bytes, str] = {}
        swapped_in: list[tuple[PageEntry, int]] = []
        try:
            reservation = self._cascade.reserve(Tier.HOST, [e for e, _ in host_bound])
            out_failed.update(reservation.failed)
            swapped_out = [(e, i) for e, i in host_bound if e.host is not None]
            # Disk copies read the pool now, before any swap-in may overwrite it.
            through = self.config.write_policy is WritePolicy.WRITE_THROUGH
            out_failed.update(self._cascade.write_disk(
                [(e, sources.row(i)) for e, i in disk_bound + (swapped_out if through else [])]))
            swapped_out = [(e, i) for e, i in swapped_out if e.key not in out_failed]
            link = self._remote_link
            link = link if link is not None and link.sends_on_store else None
            if link is not None:  # pages bound straight for disk: from the pool, while it holds them
                link.send_stored(namespace, out_keys, [e.key for e, _ in disk_bound
                                                       if e.key not in out_failed], sources)
            out_ids, in_ids = out_binding.page_ids, in_binding.page_ids
            lost = _lost_pages(out_keys, out_ids, out_failed)
            for entry, j in recall_plan.from_host:
                if int(in_ids[j]) in lost:
                    in_failed[entry.key] = _lost_page_reason(int(in_ids[j]))
                else:
                    swapped_in.append((entry, j))
            rotation = self._movers.rotate(engine, swapped_out, out_binding, swapped_in,
                                           in_binding)
            for job in rotation.swap_out_jobs:
                out_failed.update(wait_job(job))
            if link is not None:  # from host slots this call still owns (WRITING, complete)
                link.send_host_copies([e for e, _ in swapped_out if e.key not in out_failed])
            for job in rotation.swap_in_jobs:
                in_failed.update(wait_job(job))
        except BaseException as exc:
            reason = f"rotation failed: {type(exc).__name__}: {exc}"
            out_failed.update((e.key, reason) for e, _ in host_bound + disk_bound)
            in_failed.update((e.key, reason) for e, _ in recall_plan.from_host)
            raise
        finally:
            with self._lock:
                stored, to_drop = self._placement.commit_store(host_bound + disk_bound, out_failed)
                to_drop += self._placement.finish_recall(recall_plan, {})
            self._cascade.drop_from_disk(to_drop)
        tiers: list[Tier | None] = [None] * len(in_keys)
        for entry, j in swapped_in:
            if entry.key not in in_failed:
                tiers[j] = Tier.HOST
        num_swapped_in = sum(tier is Tier.HOST for tier in tiers)
        missing = list(recall_plan.missing)
        lost = _lost_pages(out_keys, out_ids, out_failed)  # now with the lanes' failures too
        later = [j for j in recall_plan.elsewhere if int(in_ids[j]) not in lost]
        for j in recall_plan.elsewhere:
            if int(in_ids[j]) in lost:
                in_failed[in_keys[j]] = _lost_page_reason(int(in_ids[j]))
        if later:  # other tiers: after the rotation, so their pages' swap-outs are done
            rest = self.recall(namespace, [in_keys[j] for j in later], outs.subset(later))
            for j, tier in zip(later, rest.tiers):
                tiers[j] = tier
            missing += rest.missing
            in_failed.update(rest.failed)
        self._counters.pages_stored += len(stored)
        self._counters.bytes_stored += len(stored) * namespace.page_bytes
        self._counters.pages_recalled += num_swapped_in
        self._counters.bytes_recalled += num_swapped_in * namespace.page_bytes
        recalled = [in_keys[j] for j, tier in enumerate(tiers) if tier is not None]
        return RotateResult(StoreResult(stored, store_plan.already_present, out_failed),
                            RecallResult(recalled, tiers, missing, in_failed))

    def _rotation_lanes(self, sources: PageAccess | None, outs: PageAccess | None
                        ) -> tuple[TransferEngine, LaneBinding, LaneBinding] | None:
        """The engine and the two sides' pool pages of a rotate whose two sides are pages of
        one engine-bound pool."""
        out_binding = sources.lane_binding() if sources is not None else None
        in_binding = outs.lane_binding() if outs is not None else None
        if out_binding is None or in_binding is None or in_binding.pool is not out_binding.pool:
            return None
        engine = self.engines.get(out_binding.engine_key)
        return (engine, out_binding, in_binding) if engine is not None else None

    def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """Remove `keys` from every tier; return how many were present.

        Copies in flight finish first: a slot is freed only when its last reader leaves.
        """
        keys = check_keys(keys)
        with self._lock:
            num_removed, to_drop = self._placement.unlink(namespace.fingerprint, keys)
        self._cascade.drop_from_disk(to_drop)
        return num_removed

    def pin(self, namespace: Namespace, keys: Sequence[bytes], ttl_s: float) -> Lease:
        """Hold the present `keys` against eviction for `ttl_s` seconds or until `unpin`."""
        keys = check_keys(keys)
        self._expire_leases()
        fingerprint = namespace.fingerprint
        with self._lock:
            entries, missing = [], []
            for key in keys:
                entry = self._table.get(fingerprint + key)
                if entry is None or entry.best_tier() is None:
                    missing.append(key)
                else:
                    entries.append(entry)
            lease_id = self._leases.add(entries, ttl_s)
            for entry in entries:
                entry.pins += 1
        return Lease(lease_id, [e.key for e in entries], missing)

    def unpin(self, lease_id: int) -> None:
        """Release a lease.

        Raises:
            ProtocolError: the lease expired or was already released.
        """
        self._expire_leases()  # an expired lease is gone even if no other verb ran since
        with self._lock:
            for entry in self._leases.pop(lease_id):
                entry.pins -= 1

    def live_leases(self, lease_ids: set[int]) -> set[int]:
        """Those of `lease_ids` that are neither released nor expired."""
        self._expire_leases()
        with self._lock:
            return {lease_id for lease_id in lease_ids if lease_id in self._leases}

    def _expire_leases(self) -> None:
        with self._lock:
            for entries in self._leases.pop_expired():
                for entry in entries:
                    entry.pins -= 1

    def stats(self) -> StoreStats:
        """A snapshot of capacities, occupancy, hit counters and traffic."""
        self._expire_leases()
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

    def flush(self) -> None:
        """Make every disk index update so far durable (the daemon calls it every second)."""
        if self.disk is not None:
            self.disk.sync_index()

    def close(self) -> None:
        """Persist disk access data, close the index and release the arena (idempotent)."""
        if self._remote_link is not None and not self._closed:
            self._remote_link.close()  # its promotions take the lock: finish them first
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


def _lost_pages(out_keys: list[bytes], out_ids: np.ndarray, failed: dict[bytes, str]) -> set[int]:
    """Pool pages whose swap-out failed: their bytes exist nowhere else."""
    return {int(page) for key, page in zip(out_keys, out_ids) if key in failed}


def _lost_page_reason(page_id: int) -> str:
    return f"the swap-out of pool page {page_id} failed: recalling into it would lose its bytes"


def _copy_into(failed: dict[bytes, str], copy: Callable[..., dict[bytes, str]],
               *args: object) -> None:
    """Run one mover route, adding the keys it did not move to `failed` (the store's host copy,
    run while the disk writes are in flight)."""
    failed.update(copy(*args))
