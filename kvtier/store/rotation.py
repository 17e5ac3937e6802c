"""Rotating pages: an engine pool's swap-outs and swap-ins in one call, on both lanes at once.

`Rotator.rotate` stores the pages of paused requests and recalls those of resumed ones; when both
sides are pages of one engine-bound pool, the swap-outs run on its d2h lane while host-resident
swap-ins run on its h2d lane, a swap-in into a pool page waiting only for that page's swap-out.
It reads plan (both sides, one hold of the lock) -> swap (the disk writes, then both lanes) ->
commit -> the swap-ins from other tiers, recalled once the rotation landed. Verb: `rotate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.keys import Namespace, check_keys
from kvtier.pools.page_access import LaneBinding, PageAccess, PageBuffers
from kvtier.store.movers import wait_job
from kvtier.store.pages import PageEntry, Tier
from kvtier.store.parts import StoreParts
from kvtier.store.planner import RecallPlan, StorePlan
from kvtier.store.recalling import Recaller
from kvtier.store.results import RecallResult, StoreResult, SwapResult
from kvtier.store.storing import Storer
from kvtier.transfer.duplex import DuplexLanes


@dataclass(slots=True)
class _Swap:
    """One rotation in flight: both sides' plans, and what each side did not do."""

    store_plan: StorePlan
    recall_plan: RecallPlan
    out_failed: dict[bytes, str]
    in_failed: dict[bytes, str] = field(default_factory=dict)
    swapped_in: list[tuple[PageEntry, int]] = field(default_factory=list)


class Rotator:
    """The `rotate` verb of `PageStore` (a store and a recall, overlapped)."""

    def __init__(self, parts: StoreParts, storer: Storer, recaller: Recaller) -> None:
        self._parts = parts
        self._storer = storer
        self._recaller = recaller

    def rotate(self, namespace: Namespace, out_keys: Sequence[bytes],
               out_pages: PageBuffers | PageAccess, in_keys: Sequence[bytes],
               in_pages: PageBuffers | PageAccess, parent_key: bytes | None = None) -> SwapResult:
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
        parts = self._parts
        out_keys, in_keys = check_keys(out_keys), check_keys(in_keys)
        sources = parts.page_rows(namespace, out_pages, len(out_keys))
        outs = parts.page_rows(namespace, in_pages, len(in_keys), writable=True)
        bound = self._rotation_lanes(sources, outs)
        if bound is None:
            return SwapResult(self._storer.store(namespace, out_keys, sources, parent_key),
                              self._recaller.recall(namespace, in_keys, outs))
        lanes, out_binding, in_binding = bound
        assert sources is not None and outs is not None  # both sides are bound pool pages
        swap = self._plan(namespace, out_keys, in_keys, parent_key)
        out_ids, in_ids = out_binding.page_ids, in_binding.page_ids
        indexed = swap.store_plan.to_host_indexed + swap.store_plan.to_disk_indexed
        try:
            self._swap(namespace, swap, out_keys, sources, lanes, out_binding, in_binding)
        except BaseException as exc:
            reason = f"rotation failed: {type(exc).__name__}: {exc}"
            swap.out_failed.update((e.key, reason) for e, _ in indexed)
            swap.in_failed.update((e.key, reason) for e, _ in swap.recall_plan.from_host)
            raise
        finally:
            with parts.lock:
                stored, to_drop = parts.planner.commit_store(indexed, swap.out_failed)
                to_drop += parts.planner.finish_recall(swap.recall_plan, {})
            parts.cascade.drop_from_disk(to_drop)
        tiers: list[Tier | None] = [None] * len(in_keys)
        for entry, j in swap.swapped_in:
            if entry.key not in swap.in_failed:
                tiers[j] = Tier.HOST
        num_swapped_in = sum(tier is Tier.HOST for tier in tiers)
        lost = _lost_pages(out_keys, out_ids, swap.out_failed)  # with the lanes' failures too
        missing = self._swap_in_from_other_tiers(namespace, swap, in_keys, outs, in_ids, lost,
                                                 tiers)
        counters = parts.counters
        counters.pages_stored += len(stored)
        counters.bytes_stored += len(stored) * namespace.page_bytes
        counters.pages_recalled += num_swapped_in
        counters.bytes_recalled += num_swapped_in * namespace.page_bytes
        recalled = [in_keys[j] for j, tier in enumerate(tiers) if tier is not None]
        return SwapResult(StoreResult(stored, swap.store_plan.already_present, swap.out_failed),
                          RecallResult(recalled, tiers, missing, swap.in_failed))

    def _plan(self, namespace: Namespace, out_keys: list[bytes], in_keys: list[bytes],
              parent_key: bytes | None) -> _Swap:
        """Both sides' plans in one hold of the lock, swap-in sources first: their reader
        counts keep them from eviction while the swap-outs make room."""
        parts = self._parts
        parts.namespaces.register(namespace)
        parts.expire_leases()
        with parts.lock:
            recall_plan = parts.planner.plan_recall(namespace, in_keys, from_tiers=(Tier.HOST,))
            relearned = parts.namespaces.relearn(namespace)
            store_plan = parts.planner.plan_store(namespace, out_keys, parent_key)
        if relearned:
            parts.namespaces.persist(namespace)
        return _Swap(store_plan, recall_plan, dict(store_plan.failed))

    def _swap(self, namespace: Namespace, swap: _Swap, out_keys: list[bytes],
              sources: PageAccess, lanes: DuplexLanes, out_binding: LaneBinding,
              in_binding: LaneBinding) -> None:
        """Reserve host slots, write what goes to disk out of the pool (before any swap-in may
        overwrite it), then run both lanes and wait for them; failures land in `swap`."""
        parts = self._parts
        host_bound, disk_bound = swap.store_plan.to_host_indexed, swap.store_plan.to_disk_indexed
        out_failed = swap.out_failed
        out_failed.update(parts.cascade.reserve(Tier.HOST, [e for e, _ in host_bound]).failed)
        swapped_out = [(e, i) for e, i in host_bound if e.host is not None]
        through = self._storer.writes_through
        out_failed.update(parts.cascade.write_disk(
            [(e, sources.row(i)) for e, i in disk_bound + (swapped_out if through else [])]))
        swapped_out = [(e, i) for e, i in swapped_out if e.key not in out_failed]
        link = parts.remote_link
        link = link if link is not None and link.sends_on_store else None
        if link is not None:  # pages bound straight for disk: from the pool, while it holds them
            link.send_stored(namespace, out_keys, [e.key for e, _ in disk_bound
                                                   if e.key not in out_failed], sources)
        lost = _lost_pages(out_keys, out_binding.page_ids, out_failed)
        in_ids = in_binding.page_ids
        for entry, j in swap.recall_plan.from_host:
            if int(in_ids[j]) in lost:
                swap.in_failed[entry.key] = _lost_page_reason(int(in_ids[j]))
            else:
                swap.swapped_in.append((entry, j))
        rotation = parts.movers.rotate(lanes, swapped_out, out_binding, swap.swapped_in,
                                       in_binding)
        for job in rotation.swap_out_jobs:
            out_failed.update(wait_job(job))
        if link is not None:  # from host slots this call still owns (WRITING, complete)
            link.send_host_copies([e for e, _ in swapped_out if e.key not in out_failed])
        for job in rotation.swap_in_jobs:
            swap.in_failed.update(wait_job(job))

    def _swap_in_from_other_tiers(self, namespace: Namespace, swap: _Swap, in_keys: list[bytes],
                                  outs: PageAccess, in_ids: np.ndarray, lost: set[int],
                                  tiers: list[Tier | None]) -> list[bytes]:
        """Recall the swap-ins host did not hold, now that the rotation landed (their pool
        pages' swap-outs are done), except into pool pages whose swap-out failed; fills in
        `tiers` and `swap.in_failed`, returns the keys missing."""
        missing = list(swap.recall_plan.missing)
        later = [j for j in swap.recall_plan.elsewhere if int(in_ids[j]) not in lost]
        for j in swap.recall_plan.elsewhere:
            if int(in_ids[j]) in lost:
                swap.in_failed[in_keys[j]] = _lost_page_reason(int(in_ids[j]))
        if later:
            rest = self._recaller.recall(namespace, [in_keys[j] for j in later],
                                         outs.subset(later))
            for j, tier in zip(later, rest.tiers):
                tiers[j] = tier
            missing += rest.missing
            swap.in_failed.update(rest.failed)
        return missing

    def _rotation_lanes(self, sources: PageAccess | None, outs: PageAccess | None
                        ) -> tuple[DuplexLanes, LaneBinding, LaneBinding] | None:
        """The engine and the two sides' pool pages of a rotate whose two sides are pages of
        one engine-bound pool."""
        out_binding = sources.lane_binding() if sources is not None else None
        in_binding = outs.lane_binding() if outs is not None else None
        if out_binding is None or in_binding is None or in_binding.pool is not out_binding.pool:
            return None
        lanes = self._parts.movers.lanes_by_key.get(out_binding.lanes_key)
        return (lanes, out_binding, in_binding) if lanes is not None else None


def _lost_pages(out_keys: list[bytes], out_ids: np.ndarray, failed: dict[bytes, str]) -> set[int]:
    """Pool pages whose swap-out failed: their bytes exist nowhere else."""
    return {int(page) for key, page in zip(out_keys, out_ids) if key in failed}


def _lost_page_reason(page_id: int) -> str:
    return f"the swap-out of pool page {page_id} failed: recalling into it would lose its bytes"
