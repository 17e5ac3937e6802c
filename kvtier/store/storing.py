"""Storing pages: plan, copy, commit, in waves when the host tier cannot take a run at once.

`Storer.store` plans new entries under the lock (host, or straight to disk when the host policy
refuses them), reserves host slots (evicting down the cascade), copies the pages into them (the
host policy filing a big wave meanwhile: `kvtier.store.filing`), under write-through run by run
of the disk writes, each run then written to disk from its host slots (pages a GPU's transfer
engine moves: all before the disk writes), and commits: a key becomes visible only with its
bytes complete (and, under write-through, durable). Verb: `store`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from kvtier.config import WritePolicy
from kvtier.errors import StorageError
from kvtier.keys import Namespace, check_keys
from kvtier.pools.page_access import PageAccess, PageBuffers
from kvtier.store.filing import PolicyFiler
from kvtier.store.movers import Endpoint
from kvtier.store.pages import PageEntry, Tier
from kvtier.store.parts import StoreParts
from kvtier.store.planner import StorePlan
from kvtier.store.results import StoreResult
from kvtier.tiers.disk import DiskWrite

Indexed = list[tuple[PageEntry, int]]  # (entry, request page index) pairs


class Storer:
    """The `store` verb of `PageStore`, over the store's shared parts."""

    def __init__(self, parts: StoreParts, filer: PolicyFiler) -> None:
        self._parts = parts
        self._filer = filer
        # Write-through: every stored page reaches disk before it is reported stored.
        self.writes_through = parts.config.write_policy is WritePolicy.WRITE_THROUGH

    def store(self, namespace: Namespace, keys: Sequence[bytes],
              pages: PageBuffers | PageAccess | None, parent_key: bytes | None = None,
              remote_write: bool = True) -> StoreResult:
        """Copy `pages[i]` into the store under `keys[i]`.

        `keys` are taken as one prefix chain (key i-1 is the parent of key i, `parent_key` the
        parent of key 0), which prefix-aware policies use. With write-through, a key is reported
        stored only once it is durable on disk.
        In metadata-only mode (`StoreConfig(with_bytes=False)`) `pages` is None. With a remote
        tier in write mode "through", stored pages are also queued for it unless `remote_write`
        is False (pages that came from it).

        Raises:
            ProtocolError: bad keys, or pages that do not match the keys or the page size.
        """
        parts = self._parts
        keys = check_keys(keys)
        sources = parts.page_rows(namespace, pages, len(keys))
        plan = self.plan(namespace, keys, parent_key)
        failed = dict(plan.failed)
        stored = self._copy_and_commit(namespace, plan, sources, failed)
        parts.placement.tidy_policies()  # off the lock: what the policies deferred
        parts.counters.pages_stored += len(stored)
        parts.counters.bytes_stored += len(stored) * namespace.page_bytes
        link = parts.remote_link
        if link is not None and remote_write and link.sends_on_store and sources is not None:
            link.send_stored(namespace, keys, stored, sources)
        return StoreResult(stored, plan.already_present, failed)

    def plan(self, namespace: Namespace, keys: list[bytes], parent_key: bytes | None
             ) -> StorePlan:
        """Register `namespace` and plan the store of `keys` under the lock."""
        parts = self._parts
        parts.namespaces.register(namespace)
        parts.expire_leases()
        with parts.lock:
            relearned = parts.namespaces.relearn(namespace)
            plan = parts.planner.plan_store(namespace, keys, parent_key)
        if relearned:
            parts.namespaces.persist(namespace)
        return plan

    def _copy_and_commit(self, namespace: Namespace, plan: StorePlan,
                         sources: PageAccess | None, failed: dict[bytes, str]) -> list[bytes]:
        """Copy and commit the planned pages, wave after wave; the keys stored."""
        parts = self._parts
        stored: list[bytes] = []
        waiting, to_disk = plan.to_host_indexed, plan.to_disk_indexed
        while True:
            wave, waiting, to_disk, given_up = self._reserve_wave(waiting, to_disk, failed)
            # The host policy files a big wave while its bytes are copied (none to copy: at
            # the commit).
            filing = (self._filer.file_wave([e for e, _ in wave])
                      if sources is not None else None)
            try:
                failed.update(self._copy_wave(namespace, wave, to_disk, sources))
            finally:
                if filing is not None:
                    filing.result()
            with parts.lock:
                committed, to_drop = parts.planner.commit_store(wave + to_disk + given_up, failed)
            stored += committed
            parts.cascade.drop_from_disk(to_drop)
            to_disk = []
            if not waiting:
                return stored

    def _reserve_wave(self, waiting: Indexed, to_disk: Indexed, failed: dict[bytes, str]
                      ) -> tuple[Indexed, Indexed, Indexed, Indexed]:
        """Host slots for as many `waiting` pages as fit: (the wave that got them, the pages
        still waiting, the pages bound for disk, the pages given up).

        A run larger than what the host can free: with a disk, its first pages stay in host and
        the rest go straight to disk (the prefix stays whole, in the fastest tier, and no page
        is copied twice). Without one, in waves: pages stored by one wave become evictable
        (spilled to a remote tier, or dropped), so it completes.
        """
        reservation = self._parts.cascade.reserve(Tier.HOST, [e for e, _ in waiting])
        if len(reservation.reserved) == len(waiting):
            wave, waiting = waiting, []
        else:  # these entries are this call's own, so a host residency means reserved here
            wave = [(e, i) for e, i in waiting if e.host is not None]
            waiting = [(e, i) for e, i in waiting if e.host is None]
            if self._parts.placement.disk is not None:
                to_disk, waiting = to_disk + waiting, []
        given_up: Indexed = []
        if waiting and not wave:  # no progress: nothing left in host may be evicted
            failed.update(reservation.failed)
            given_up, waiting = waiting, []
        return wave, waiting, to_disk, given_up

    def _copy_wave(self, namespace: Namespace, wave: Indexed, to_disk: Indexed,
                   sources: PageAccess | None) -> dict[bytes, str]:
        """Copy a wave into its host slots and write the disk-bound pages (and, under
        write-through, the wave) to disk; {key: problem} for the pages not copied."""
        parts = self._parts
        copy_failed: dict[bytes, str] = {}
        copy_wave: Callable[[], None] | None = None
        if sources is not None:
            copy_wave = partial(_copy_into, copy_failed, parts.movers.copy, Endpoint.PAGES,
                                Tier.HOST, wave, sources)
        disk_sources: list[tuple[PageEntry, np.ndarray | None]] = [
            (e, sources.row(i) if sources else None) for e, i in to_disk]
        before_run = None
        if self.writes_through and wave:
            host = parts.placement.host
            if sources is not None and not parts.movers.copies_by_lane(sources):
                # Copied here, in this thread: each run of the disk writes is copied into its
                # host slots just before it is hashed and written from them, while its bytes
                # are in the CPU's caches (the rest of the wave, at the end). The request's
                # pages are read once, and host and disk hold the same bytes.
                run_copier = _RunCopier(parts.movers.copy, wave, sources)
                before_run, copy_wave = run_copier.copy_run, run_copier.copy_rest
                disk_sources += [(e, host.view(e.host.slot, namespace.page_bytes))
                                 for e, _ in wave if e.host is not None]
            elif copy_wave is not None:
                # An engine's pages moved by its transfer engine go to disk from the host
                # slots they landed in: the pool is read once (on a GPU, a PCIe crossing).
                copy_wave()
                copy_wave = None
                disk_sources += [(e, host.view(e.host.slot, namespace.page_bytes))
                                 for e, _ in wave if e.host is not None
                                 and e.key not in copy_failed]
            else:  # metadata only
                disk_sources += [(e, None) for e, _ in wave]
        if disk_sources:  # in key order: a run's pages get adjacent slots, read back at once
            order = {id(e): i for e, i in to_disk + wave}
            disk_sources.sort(key=lambda pair: order[id(pair[0])])
        # Otherwise the host copy runs while the disk writes are in flight.
        failed = parts.cascade.write_disk(disk_sources, copy_wave, before_run)
        failed.update(copy_failed)
        return failed


class _RunCopier:
    """A write-through wave's host copy, run by run of its disk writes (`before_run`), then
    the pages no run held (`copy_rest`)."""

    def __init__(self, copy: Callable[..., dict[bytes, str]], wave: Indexed,
                 sources: PageAccess) -> None:
        self._copy = copy
        self._sources = sources
        self._left: dict[bytes, Indexed] = {}  # scoped key: the wave's pages not copied yet
        for entry, index in wave:
            self._left.setdefault(entry.scoped_key, []).append((entry, index))

    def copy_run(self, run: list[DiskWrite]) -> None:
        """Copy the wave's pages among `run`'s writes into their host slots.

        Raises:
            StorageError: the copy failed for some page (its disk write must not be made from
                its host slot): the whole write fails, its pages are not stored.
        """
        left = self._left
        pages: Indexed = []
        for write in run:
            pages += left.pop(write.scoped_key, ())
        self._copy_checked(pages)

    def copy_rest(self) -> None:
        """Copy the wave's pages that no run held (refused by the disk, or no disk write)."""
        pages = [page for pages in self._left.values() for page in pages]
        self._left.clear()
        self._copy_checked(pages)

    def _copy_checked(self, pages: Indexed) -> None:
        if not pages:
            return
        failed = self._copy(Endpoint.PAGES, Tier.HOST, pages, self._sources)
        if failed:  # a copy in this thread fails whole (it raises); this is a guard
            key, problem = next(iter(failed.items()))
            raise StorageError(f"host copy of {len(failed)} pages failed ({key.hex()}: "
                               f"{problem})")


def _copy_into(failed: dict[bytes, str], copy: Callable[..., dict[bytes, str]],
               *args: object) -> None:
    """Run one mover route, adding the keys it did not move to `failed` (the store's host copy,
    run while the disk writes are in flight)."""
    failed.update(copy(*args))
