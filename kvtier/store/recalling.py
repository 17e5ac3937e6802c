"""Recalling pages: plan, copy, commit, then promote what the policies keep.

`Recalling.recall` takes reader counts under the lock (placement's plan), copies each key from
its fastest tier through the movers (hbm and host hits straight into the request's pages, disk
hits verified into the landing rows first), drops the reader counts, then promotes: verified disk
hits into host from the rows they landed in, hot host hits into hbm. Keys missing locally are
asked of the remote tier. `prefetch` promotes disk-resident pages ahead of a recall.
Verbs: `recall`, `prefetch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.keys import Namespace, check_keys
from kvtier.store.core import StoreCore
from kvtier.store.movers import Endpoint
from kvtier.store.pages import PageEntry, Tier
from kvtier.store.results import RecallResult
from kvtier.pools.page_access import PageAccess, PageBuffers


class Recalling(StoreCore):
    """The `recall` and `prefetch` verbs of `PageStore`."""

    def recall(self, namespace: Namespace, keys: Sequence[bytes],
               out: PageBuffers | PageAccess | None) -> RecallResult:
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
            # Promoted while the disk copies are still read-held: making host room may demote
            # into disk, and the disk must not make that room by dropping these very pages.
            self._promote([(e, i) for e, i in plan.from_disk if e.key not in failed], outs)
        finally:
            with self._lock:
                to_drop = self._placement.finish_recall(plan, failed)
            self._cascade.drop_from_disk(to_drop)
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

        assert self._remote_link is not None  # the caller checked
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

