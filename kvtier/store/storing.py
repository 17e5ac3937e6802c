"""Storing pages: plan, copy, commit, in waves when the host tier cannot take a run at once.

`Storing.store` plans new entries under the lock (host, or straight to disk when the host policy
refuses them), reserves host slots (evicting down the cascade), copies the pages into them while
a write-through store's disk writes are in flight (an engine pool's pages: before them, the disk
writes then made from the host slots, so the pool is read once), and commits: a key becomes visible only with
its bytes complete (and, under write-through, durable). Verb: `store`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from kvtier.config import WritePolicy
from kvtier.keys import Namespace, check_keys
from kvtier.store.core import StoreCore
from kvtier.store.movers import Endpoint
from kvtier.store.pages import Tier
from kvtier.store.results import StoreResult
from kvtier.pools.page_access import PageAccess, PageBuffers, PageRows


class Storing(StoreCore):
    """The `store` verb of `PageStore`."""

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
            disk_sources = [(e, sources.row(i) if sources else None) for e, i in to_disk]
            if through and wave:
                if copy_wave is not None and not isinstance(sources, PageRows):
                    # An engine pool's pages go to disk from the host slots they just landed
                    # in: the pool is read once (on a GPU, each read is a PCIe crossing).
                    copy_wave()
                    copy_wave = None
                    disk_sources += [(e, self.host.view(e.host.slot, namespace.page_bytes))
                                     for e, _ in wave if e.host is not None
                                     and e.key not in copy_failed]
                else:  # a caller's buffers: its rows are views, and the host copy overlaps
                    disk_sources += [(e, sources.row(i) if sources else None) for e, i in wave]
            # In key order: a run's pages get adjacent slots, read back in one system call.
            order = {id(e): i for e, i in to_disk + wave}
            disk_sources.sort(key=lambda pair: order[id(pair[0])])
            # Otherwise the host copy runs while the disk writes are in flight.
            failed.update(self._cascade.write_disk(disk_sources, copy_wave))
            failed.update(copy_failed)
            with self._lock:
                committed, to_drop = self._placement.commit_store(wave + to_disk + given_up,
                                                                  failed)
            stored += committed
            self._cascade.drop_from_disk(to_drop)
            to_disk = []
            if not waiting:
                break
        self._placement.tidy_policies()  # off the lock: what the policies deferred
        self._counters.pages_stored += len(stored)
        self._counters.bytes_stored += len(stored) * namespace.page_bytes
        link = self._remote_link
        if link is not None and remote_write and link.sends_on_store and sources is not None:
            link.send_stored(namespace, keys, stored, sources)
        return StoreResult(stored, plan.already_present, failed)


def _copy_into(failed: dict[bytes, str], copy: Callable[..., dict[bytes, str]],
               *args: object) -> None:
    """Run one mover route, adding the keys it did not move to `failed` (the store's host copy,
    run while the disk writes are in flight)."""
    failed.update(copy(*args))
