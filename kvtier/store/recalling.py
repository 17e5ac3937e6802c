"""Recalling pages, read top-down: plan -> copy -> commit -> promote.

`Recaller.recall`:

1. plan (under the lock): each key's fastest tier, with a reader count taken on it, its hit
   counted by the tier's policy (a big recall's during step 2: `kvtier.store.filing`);
2. copy (without it): hbm and host hits straight into the request's pages, disk hits verified
   into the landing rows first (nothing corrupt reaches the pages), then the keys missing
   locally asked of the remote tier;
3. commit (under the lock): pick the hits the policies copy up, drop every other reader count,
   and the disk copies that failed their check;
4. promote (the cascade, one step): hot host hits into hbm, verified disk hits into host from
   the rows they landed in; their reader counts are dropped only then, so making room cannot
   evict the very pages being promoted (a promotion never ends with them in no tier). Into an
   engine pool on running lanes, the disk hits land only now: those copied up from their new
   host slots on the h2d lane, batched as host hits are, the others from their landing rows.

`prefetch` promotes disk-resident pages ahead of a recall. Verbs: `recall`, `prefetch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.keys import Namespace, check_keys
from kvtier.pools.page_access import PageAccess, PageBuffers
from kvtier.store.filing import PolicyFiler
from kvtier.store.movers import Endpoint
from kvtier.store.pages import Tier
from kvtier.store.parts import StoreParts
from kvtier.store.planner import RecallPlan
from kvtier.store.results import RecallResult


class Recaller:
    """The `recall` and `prefetch` verbs of `PageStore`, over the store's shared parts."""

    def __init__(self, parts: StoreParts, filer: PolicyFiler) -> None:
        self._parts = parts
        self._filer = filer

    def recall(self, namespace: Namespace, keys: Sequence[bytes],
               out: PageBuffers | PageAccess | None) -> RecallResult:
        """Copy the pages of `keys` into `out[i]`; a disk hit is verified, then promoted to host.

        `out[i]` is written only when key i is in the result's `recalled`; nothing corrupt or
        partial is ever copied into it. In metadata-only mode `out` is None.

        Raises:
            ProtocolError: bad keys, or `out` does not match the keys or the page size.
        """
        parts = self._parts
        keys = check_keys(keys)
        outs = parts.page_rows(namespace, out, len(keys), writable=True)
        parts.expire_leases()
        with parts.lock:  # 1. plan; a big recall's hits are counted during its copy
            if outs is None:  # metadata-only: no copy to count them during
                plan, counting = parts.planner.plan_recall(namespace, keys), None
            else:
                plan = parts.planner.plan_recall(namespace, keys, count_hits=False)
                counting = self._filer.count_hits(plan, namespace.page_bytes)
        held: RecallPlan | None = plan  # the sources this call still holds a reader count on
        # Disk hits into pages on running lanes land after step 4: those copied up go on from
        # their host slots on the h2d lane, the rest from the landing rows.
        defer_landing = outs is not None and bool(plan.from_disk) and parts.movers.rides_lanes(
            outs)
        to_land: list[int] = []
        try:
            try:
                failed, corrupt = self._copy(plan, outs, defer_landing)  # 2. copy
            finally:
                if counting is not None:
                    counting.result()
            if defer_landing:
                to_land = [i for entry, i in plan.from_disk if entry.key not in corrupt]
            tiers = plan.served_tiers(len(keys), failed)
            missing = plan.missing
            if missing and parts.remote_link is not None and outs is not None:
                missing = self._copy_from_remote(namespace, keys, tiers, outs)
            with parts.lock:  # 3. commit
                promotion = parts.planner.plan_promotions(plan, failed)
                released, held = plan.split(promotion.sources)
                to_drop = parts.planner.finish_recall(released, corrupt)
            parts.cascade.drop_from_disk(to_drop)
            delivered = parts.cascade.promote(promotion, outs, defer_landing)  # 4. promote
            to_land = [i for i in to_land if i not in delivered]
        finally:
            if to_land:
                assert outs is not None
                outs.land(to_land)
            if held is not None:
                with parts.lock:
                    to_drop = parts.planner.finish_recall(held, {})
                parts.cascade.drop_from_disk(to_drop)
        parts.placement.tidy_policies()  # off the lock: what the policies deferred
        recalled = [keys[i] for i, tier in enumerate(tiers) if tier is not None]
        parts.counters.pages_recalled += len(recalled)
        parts.counters.bytes_recalled += len(recalled) * namespace.page_bytes
        return RecallResult(recalled, tiers, missing, failed)

    def _copy(self, plan: RecallPlan, outs: PageAccess | None, defer_landing: bool
              ) -> tuple[dict[bytes, str], dict[bytes, str]]:
        """Copy each planned key from its tier into `outs` (disk hits into its landing rows
        only, with `defer_landing`): ({key: problem} of every key not copied, the disk ones
        among them, which failed their check or could not be read)."""
        if outs is None:  # metadata-only: there are no bytes to move
            return {}, {}
        movers = self._parts.movers
        failed = movers.copy(Tier.HBM, Endpoint.PAGES, plan.from_hbm, outs)
        failed.update(movers.copy(Tier.HOST, Endpoint.PAGES, plan.from_host, outs))
        disk_to = Endpoint.LANDED if defer_landing else Endpoint.PAGES
        corrupt = movers.copy(Tier.DISK, disk_to, plan.from_disk, outs)
        failed.update(corrupt)
        return failed, corrupt

    def _copy_from_remote(self, namespace: Namespace, keys: list[bytes],
                          tiers: list[Tier | None], outs: PageAccess) -> list[bytes]:
        """Serve keys missing locally from the remote tier; the keys still missing."""
        indices = [i for i, key in enumerate(keys) if tiers[i] is None]

        def copy_out(found: dict[int, memoryview]) -> None:
            for index, payload in found.items():
                np.copyto(outs.landing_row(index), np.frombuffer(payload, np.uint8))
                tiers[index] = Tier.REMOTE
            outs.land(sorted(found))

        link = self._parts.remote_link
        assert link is not None  # the caller checked
        found = link.fetch_missing(namespace, keys, indices, list(tiers), copy_out)
        return [keys[i] for i in indices if i not in found]

    def prefetch(self, namespace: Namespace, keys: Sequence[bytes],
                 batch_pages: int = 64) -> RecallResult:
        """Promote the disk-resident pages of `keys` into host, verified, ahead of a recall.

        Keys already in host are left alone; absent keys are reported missing.
        """
        parts = self._parts
        keys = check_keys(keys)
        with parts.lock:
            tiers = [parts.placement.best_tier(namespace.fingerprint + key) for key in keys]
        link = parts.remote_link
        if link is not None and None in tiers:
            fetched = link.fetch_missing(
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
                       if parts.config.with_bytes else None)
            result = self.recall(namespace, batch, scratch)
            recalled += result.recalled
            missing += result.missing
            failed.update(result.failed)
        promoted = set(recalled)
        from_remote = [key for key, tier in zip(keys, tiers) if tier is Tier.REMOTE]
        return RecallResult(recalled + from_remote,
                            [Tier.DISK if k in promoted else tier if tier is Tier.REMOTE else None
                             for k, tier in zip(keys, tiers)], missing, failed)
