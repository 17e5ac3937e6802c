"""Movers: every byte move of the page store, one route per (source, destination) pair.

Placement decides under the store's lock (which slots, which states); the routes copy without
it, between slots placement reserved and marked. `CopyRoutes` registers one route per pair, as
vLLM's offload handlers do per medium pair, and only for the tiers the store has. Two kinds:

- request routes (`copy`), between a tier and a request's pages (`Endpoint.PAGES`: a caller's
  buffers or an engine pool's pages; `Endpoint.LANDED`: the rows a disk read of those pages
  landed in). They take (entry, index) pairs, index being the request page.
- tier routes (`move`), between two tiers (host <-> hbm). They take entries: no request page.

Each returns {key: problem} for the pages it did not move. Pages bound to a transfer engine
(`PageAccess.lane_binding`) move on its lanes: stores on the d2h lane, recalls on the h2d lane,
each batch as few large copies; hbm hits go through an engine whose arena is the hbm tier (device
to device on a GPU). Other pages are copied in the caller's thread. (Not to be confused with a
lane's `kvtier.transfer.lane.Mover`, which copies for one lane direction.)
Verbs: `copy`, `move`, `write_disk`, `rotate`, `open_lanes`, `rides_lanes`, `close`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, cast

import numpy as np

from kvtier.errors import ProtocolError, TransferError
from kvtier.pools.page_access import LaneBinding, PageAccess, PageRows
from kvtier.store.pages import PageEntry, PageState, Residency, Tier
from kvtier.tiers.base import DeviceArenaTier, DiskStorage, HostArenaTier
from kvtier.tiers.disk import DiskRead, DiskWrite
from kvtier.transfer.cpu import CpuBackend
from kvtier.transfer.duplex import Backend, DuplexLanes, Rotation, Swap
from kvtier.transfer.jobs import LaneJob, PoolMemory, PoolPageIds

if TYPE_CHECKING:
    from kvtier.transfer.cuda import CudaBackend

Indexed = Sequence[tuple[PageEntry, int]]  # (entry, request page index) pairs


class Endpoint(Enum):
    """Where bytes move to or from that is not a tier."""

    PAGES = "pages"  # a request's pages: a caller's buffers or an engine pool's pages
    LANDED = "landed"  # the rows a disk read of a request's pages landed in (`row(index)`)


Place = Tier | Endpoint
RequestRoute = Callable[[Indexed, PageAccess], dict[bytes, str]]
TierRoute = Callable[[Sequence[PageEntry]], dict[bytes, str]]


class CopyRoutes:
    """The routes between the store's tiers and a request's pages.

    Args:
        host: the host tier (always there).
        hbm: the hbm tier, or None.
        disk: the disk tier, or None.
    """

    def __init__(self, host: HostArenaTier, hbm: DeviceArenaTier | None,
                 disk: DiskStorage | None) -> None:
        self.host = host
        self.hbm = hbm
        self.disk = disk
        self.lanes_by_key: dict[str, DuplexLanes] = {}
        # Per engine key, an engine whose arena is the hbm tier: recalls of hbm hits into that
        # engine's pools (device to device on a GPU).
        self.hbm_lanes_by_key: dict[str, DuplexLanes] = {}
        self._request_routes: dict[tuple[Place, Place], RequestRoute] = {}
        self._tier_routes: dict[tuple[Tier, Tier], TierRoute] = {}
        self.register(Endpoint.PAGES, Tier.HOST, self._pages_to_host)
        self.register(Endpoint.LANDED, Tier.HOST, self._landed_to_host)
        self.register(Tier.HOST, Endpoint.PAGES, self._host_to_pages)
        if disk is not None:
            self.register(Tier.DISK, Endpoint.PAGES, self._disk_to_pages)
            self.register(Tier.DISK, Endpoint.LANDED, self._disk_to_landed)
        if hbm is not None:
            self.register(Tier.HBM, Endpoint.PAGES, self._hbm_to_pages)
            self.register_between(Tier.HOST, Tier.HBM, self._host_to_hbm)
            self.register_between(Tier.HBM, Tier.HOST, self._hbm_to_host)

    def register(self, source: Place, destination: Place, route: RequestRoute) -> None:
        """Serve copies between a tier and a request's pages from `source` to `destination`."""
        self._request_routes[source, destination] = route

    def register_between(self, source: Tier, destination: Tier, route: TierRoute) -> None:
        """Serve moves from tier `source` to tier `destination`."""
        self._tier_routes[source, destination] = route

    def copy(self, source: Place, destination: Place, pages: Indexed,
             request: PageAccess) -> dict[bytes, str]:
        """Copy `pages` between a tier and `request`; {key: problem} for those not copied.

        Tier slots are the entries' residencies (reserved or read-held by placement); index i
        of each (entry, i) pair is page i of `request`.
        """
        if not pages:
            return {}
        return self._request_routes[source, destination](pages, request)

    def move(self, source: Tier, destination: Tier, entries: Sequence[PageEntry]
             ) -> dict[bytes, str]:
        """Move `entries` from their slots in `source` to those placement reserved in
        `destination`; {key: problem} for those not moved."""
        if not entries:
            return {}
        return self._tier_routes[source, destination](entries)

    def copies_by_lane(self, request: PageAccess) -> bool:
        """Whether a store's copy of `request`'s pages into host slots goes through a running
        transfer engine (a GPU's copy engines), not the calling thread."""
        binding = request.lane_binding()
        return binding is not None and binding.lanes_key in self.lanes_by_key

    def write_disk(self, writes: Sequence[DiskWrite],
                   overlap: Callable[[], None] | None = None,
                   before_run: Callable[[list[DiskWrite]], None] | None = None) -> None:
        """Write `writes` durably to their disk slots (any source: their payloads are host
        bytes); `overlap()` runs once while the writes are in flight, `before_run(run)` before
        each run of them is written (`DiskTier.write_pages`). Fills in checksums.

        Raises:
            StorageError: the writes failed (none of them is indexed).
        """
        assert self.disk is not None
        self.disk.write_pages(writes, overlap, before_run)

    def readable_bytes(self, entry: PageEntry) -> np.ndarray | None:
        """The bytes of `entry`'s fastest memory copy (host, else hbm) as a host array: the
        source of its disk write at close. A copy off the GPU for an hbm-only page."""
        host = entry.host
        if host is not None and host.state is PageState.READY:
            return self.host.view(host.slot, entry.namespace.page_bytes)
        assert self.hbm is not None and entry.hbm is not None
        return self.hbm.view(entry.hbm.slot, entry.namespace.page_bytes)

    def rotate(self, lanes: DuplexLanes, swapped_out: Indexed, out_binding: LaneBinding,
               swapped_in: Indexed, in_binding: LaneBinding) -> Rotation:
        """Swap pool pages out into their host slots and host slots into pool pages, on the
        two lanes at once (a swap-in waits for the swap-out of its own page only)."""
        out_ids, in_ids = out_binding.page_ids, in_binding.page_ids
        return lanes.rotate(
            Swap(_pool_pages(out_binding.pool, out_ids[[i for _, i in swapped_out]]),
                 [_slot(e.host) for e, _ in swapped_out], [e.key for e, _ in swapped_out]),
            Swap(_pool_pages(in_binding.pool, in_ids[[j for _, j in swapped_in]]),
                 [_slot(e.host) for e, _ in swapped_in], [e.key for e, _ in swapped_in]))

    def open_lanes(self, lanes_key: str, backend: Backend) -> DuplexLanes:
        """A transfer engine over the host arena under `lanes_key`, started on first call
        (see `PageStore.open_lanes`).

        Raises:
            ProtocolError: a metadata-only store has no arena to move pages to.
        """
        lanes = self.lanes_by_key.get(lanes_key)
        if lanes is None:
            if self.host.arena is None:
                raise ProtocolError("a metadata-only store has no arena for a transfer engine")
            lanes = self.lanes_by_key[lanes_key] = DuplexLanes(backend, self.host.arena)
            hbm_backend = _hbm_backend(backend, self.hbm) if self.hbm is not None else None
            if hbm_backend is not None and self.hbm is not None and self.hbm.arena is not None:
                self.hbm_lanes_by_key[lanes_key] = DuplexLanes(hbm_backend, self.hbm.arena)
        return lanes

    def close(self) -> None:
        """Drain and stop every engine (before the arenas go away)."""
        for lanes in [*self.lanes_by_key.values(), *self.hbm_lanes_by_key.values()]:
            lanes.close()

    def _lane(self, lanes_by_key: dict[str, DuplexLanes], request: PageAccess, pages: Indexed
              ) -> tuple[DuplexLanes, PoolPageIds] | None:
        """The lanes and pool pages of `pages` when `request` is bound to running lanes."""
        binding = request.lane_binding()
        lanes = lanes_by_key.get(binding.lanes_key) if binding is not None else None
        if binding is None or lanes is None:
            return None
        return lanes, _pool_pages(binding.pool, binding.page_ids[[i for _, i in pages]])

    def _pages_to_host(self, pages: Indexed, request: PageAccess) -> dict[bytes, str]:
        """A store: request pages into host slots, on the d2h lane when bound to one."""
        pairs = [(_slot(e.host), i) for e, i in pages]
        lane = self._lane(self.lanes_by_key, request, pages)
        if lane is None:
            self.host.copy_in(pairs, request)
            return {}
        lanes, pool_pages = lane
        return wait_job(lanes.submit_store(pool_pages, [slot for slot, _ in pairs],
                                             [e.key for e, _ in pages]))

    def _landed_to_host(self, pages: Indexed, request: PageAccess) -> dict[bytes, str]:
        """A disk hit's promotion, from the rows it landed in: an engine pool's pages are not
        read back out of the pool (on a GPU that would be a second PCIe crossing)."""
        if isinstance(request, PageRows):  # a caller's buffers: the rows landed in place, and
            # adjacent pages in adjacent slots go as one copy (`copy_runs`), as a store's do
            self.host.copy_in([(_slot(e.host), i) for e, i in pages], request)
            return {}
        landed = PageRows(None, request.page_bytes, [request.row(i) for _, i in pages])
        self.host.copy_in([(_slot(e.host), n) for n, (e, _) in enumerate(pages)], landed)
        return {}

    def _host_to_pages(self, pages: Indexed, request: PageAccess) -> dict[bytes, str]:
        """A recall of host hits: the mirror of a store, on the h2d lane when bound to one."""
        pairs = [(_slot(e.host), i) for e, i in pages]
        lane = self._lane(self.lanes_by_key, request, pages)
        if lane is None:
            self.host.copy_out(pairs, request)
            return {}
        lanes, pool_pages = lane
        return wait_job(lanes.submit_recall(pool_pages, [slot for slot, _ in pairs],
                                              [e.key for e, _ in pages]))

    def _hbm_to_pages(self, pages: Indexed, request: PageAccess) -> dict[bytes, str]:
        """A recall of hbm hits: on the h2d lane of the engine over the hbm tier when bound to
        one (device to device on a GPU), else by the tier."""
        assert self.hbm is not None
        pairs = [(_slot(e.hbm), i) for e, i in pages]
        lane = self._lane(self.hbm_lanes_by_key, request, pages)
        if lane is None:
            self.hbm.copy_out(pairs, request)
            return {}
        lanes, pool_pages = lane
        return wait_job(lanes.submit_recall(pool_pages, [slot for slot, _ in pairs],
                                              [e.key for e, _ in pages]))

    def _disk_to_pages(self, pages: Indexed, request: PageAccess) -> dict[bytes, str]:
        """A recall of disk hits: read and verify into the landing rows, then land the pages
        that passed (nothing corrupt or partial reaches the request's pages)."""
        problems = self._disk_to_landed(pages, request)
        request.land([i for e, i in pages if e.key not in problems])
        return problems

    def _disk_to_landed(self, pages: Indexed, request: PageAccess) -> dict[bytes, str]:
        """Disk hits read and verified into the request's landing rows only: the caller lands
        them (or copies them up first and sends them on the h2d lane from there)."""
        assert self.disk is not None
        reads = [DiskRead(e.scoped_key, _slot(e.disk), e.namespace.page_bytes,
                          _checksum(e), request.landing_row(i)) for e, i in pages]
        problems = self.disk.read_pages(reads)
        return {scoped[16:]: problem for scoped, problem in problems.items()}

    def rides_lanes(self, request: PageAccess) -> bool:
        """Whether `request` is bound to running lanes (its host copies move on them)."""
        binding = request.lane_binding()
        return binding is not None and binding.lanes_key in self.lanes_by_key

    def _host_to_hbm(self, entries: Sequence[PageEntry]) -> dict[bytes, str]:
        """A promotion of hot host pages into hbm."""
        assert self.hbm is not None and self.host.arena is not None
        for entry in entries:
            self.hbm.copy_from_host([(_slot(entry.hbm), _slot(entry.host))], self.host.arena,
                                    entry.namespace.page_bytes)
        return {}

    def _hbm_to_host(self, entries: Sequence[PageEntry]) -> dict[bytes, str]:
        """A demotion of hbm victims into host."""
        assert self.hbm is not None and self.host.arena is not None
        for entry in entries:
            self.hbm.copy_to_host([(_slot(entry.hbm), _slot(entry.host))], self.host.arena,
                                  entry.namespace.page_bytes)
        return {}


def _pool_pages(pool: PoolMemory, page_ids: np.ndarray) -> PoolPageIds:
    # An int64 array is the Sequence[int] a job takes (the lanes index it as an array).
    return PoolPageIds(pool, cast(Sequence[int], page_ids))


def _slot(residency: Residency | None) -> int:
    """The slot of a residency placement reserved or read-held for this move."""
    assert residency is not None
    return residency.slot


def _checksum(entry: PageEntry) -> int:
    assert entry.checksum is not None  # a READY disk copy always has one
    return entry.checksum


def _hbm_backend(backend: Backend, hbm: DeviceArenaTier) -> Backend | None:
    """A backend like `backend` whose arena is the hbm tier, or None when it cannot reach it."""
    if backend.name == "cpu" and not hbm.on_device:
        return CpuBackend()
    if (backend.name == "cuda" and hbm.on_device
            and cast("CudaBackend", backend).device_id == hbm.device):
        from kvtier.transfer import cuda  # only reached with CuPy imported

        return cuda.CudaBackend(hbm.device, num_staging_buffers=1, staging_bytes=1 << 20,
                           device_arena_address=hbm.address)
    return None


def wait_job(job: LaneJob) -> dict[bytes, str]:
    """Wait for a lane job; {key: reason} for each key it did not move."""
    try:
        job.result()
    except TransferError as exc:
        return {key: str(exc) for key in exc.failed_keys}
    return {}

