"""Rotating pages: an engine pool's swap-outs and swap-ins in one call, on both lanes at once.

`Rotating.rotate` stores the pages of paused requests and recalls those of resumed ones; when both
sides are pages of one engine-bound pool, the swap-outs run on its d2h lane while host-resident
swap-ins run on its h2d lane, a swap-in into a pool page waiting only for that page's swap-out.
Verb: `rotate`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.config import WritePolicy
from kvtier.keys import Namespace, check_keys
from kvtier.store.movers import wait_job
from kvtier.store.pages import PageEntry, Tier
from kvtier.store.recalling import Recalling
from kvtier.store.results import RecallResult, StoreResult, SwapResult
from kvtier.store.storing import Storing
from kvtier.tiers.page_rows import LaneBinding, PageAccess, PageBuffers
from kvtier.transfer.duplex import DuplexLanes


class Rotating(Storing, Recalling):
    """The `rotate` verb of `PageStore` (a store and a recall, overlapped)."""

    def rotate(self, namespace: Namespace, out_keys: Sequence[bytes], out_pages: PageBuffers | PageAccess,
               in_keys: Sequence[bytes], in_pages: PageBuffers | PageAccess,
               parent_key: bytes | None = None) -> SwapResult:
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
        bound = self._rotation_lanes(sources, outs)
        if bound is None:
            return SwapResult(self.store(namespace, out_keys, sources, parent_key),
                                self.recall(namespace, in_keys, outs))
        lanes, out_binding, in_binding = bound
        assert sources is not None and outs is not None  # both sides are bound pool pages
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
            rotation = self._movers.rotate(lanes, swapped_out, out_binding, swapped_in,
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
        return SwapResult(StoreResult(stored, store_plan.already_present, out_failed),
                            RecallResult(recalled, tiers, missing, in_failed))

    def _rotation_lanes(self, sources: PageAccess | None, outs: PageAccess | None
                        ) -> tuple[DuplexLanes, LaneBinding, LaneBinding] | None:
        """The engine and the two sides' pool pages of a rotate whose two sides are pages of
        one engine-bound pool."""
        out_binding = sources.lane_binding() if sources is not None else None
        in_binding = outs.lane_binding() if outs is not None else None
        if out_binding is None or in_binding is None or in_binding.pool is not out_binding.pool:
            return None
        lanes = self.lanes_by_key.get(out_binding.lanes_key)
        return (lanes, out_binding, in_binding) if lanes is not None else None

def _lost_pages(out_keys: list[bytes], out_ids: np.ndarray, failed: dict[bytes, str]) -> set[int]:
    """Pool pages whose swap-out failed: their bytes exist nowhere else."""
    return {int(page) for key, page in zip(out_keys, out_ids) if key in failed}


def _lost_page_reason(page_id: int) -> str:
    return f"the swap-out of pool page {page_id} failed: recalling into it would lose its bytes"
