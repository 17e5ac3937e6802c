"""The transfer engine: a store lane (d2h) and a recall lane (h2d) running at the same time.

Callers submit jobs (pool pages <-> host arena slots, one key per page) and wait on them; each
lane batches every queued job of a tick into few large copies on its own thread (and, on CUDA, its
own stream and staging ring). `rotate` swaps pages out and in in one call, the swap-in of a slot
waiting only on the swap-out of that same slot. The backend is chosen once, at construction.
Verbs: `submit_store`, `submit_recall`, `rotate`, `lane_stats`, `close`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvtier.errors import ProtocolError, TransferError
from kvtier.pools.layout import PoolMemory
from kvtier.transfer.jobs import Direction, Indices, LaneJob, PoolPageIds, Ready, check_entries
from kvtier.transfer.lane import Lane, Mover


class Backend(Protocol):
    """What the engine needs of a backend (`CpuBackend`, `CudaBackend`)."""

    name: str

    def open_mover(self, direction: Direction, arena: np.ndarray) -> Mover:
        """The copy engine of one lane."""

    def check_pool(self, pool: PoolMemory) -> None:
        """Raise ProtocolError for a pool this backend cannot address."""

    def close(self) -> None:
        """Release what the backend holds."""


@dataclass(slots=True, frozen=True)
class Swap:
    """Pages of one pool paired with arena slots and keys: one side of a `rotate`."""

    pages: PoolPageIds
    slot_offsets: Indices
    keys: Sequence[bytes]


@dataclass(slots=True, frozen=True)
class LaneStats:
    """What one lane did since start."""

    num_ticks: int
    bytes_moved: int
    busy_s: float


class Rotation:
    """The jobs of one `rotate`: swap-outs (d2h) and swap-ins (h2d)."""

    def __init__(self, swap_out_jobs: list[LaneJob], swap_in_jobs: list[LaneJob]) -> None:
        self.swap_out_jobs = swap_out_jobs
        self.swap_in_jobs = swap_in_jobs

    def result(self, timeout_s: float | None = None) -> None:
        """Wait for every job of the rotation.

        Raises:
            TransferError: naming exactly the keys (swapped out or in) that did not move.
            TimeoutError: `timeout_s` passed first.
        """
        failed: list[bytes] = []
        for job in self.swap_out_jobs + self.swap_in_jobs:
            if not job.wait(timeout_s):
                raise TimeoutError("rotation still running")
            failed += job.failed_keys()
        if failed:
            raise TransferError(f"rotation: {len(failed)} pages not moved", failed)


class DuplexLanes:
    """Two lanes over one host arena; pools are addressed per job.

    Args:
        backend: `CpuBackend()` or `CudaBackend(...)`, fixed for the engine's life.
        arena: the host tier's arena, a flat uint8 array (`HostTier`'s shared-memory segment).
    """

    def __init__(self, backend: Backend, arena: np.ndarray) -> None:
        self.backend = backend
        self.arena = arena
        attach = getattr(backend, "attach_arena", None)
        if attach is not None:  # CUDA: starts pinning in the background
            attach(arena)
        self.lanes = {direction: Lane(direction, backend.open_mover(direction, arena))
                      for direction in Direction}
        self._closed = False

    def submit_store(self, pages: PoolPageIds, slot_offsets: Indices,
                     keys: Sequence[bytes], ready: Ready | None = None) -> LaneJob:
        """Copy pool page `pages.page_ids[i]` into the arena at `slot_offsets[i]` (key `keys[i]`).

        `ready` holds the copy until the engine's write of those pages finished: a
        threading.Event, a LaneJob, a callable polled until True, or on CUDA a CuPy event.

        Raises:
            ProtocolError: lists of different lengths, a page or slot out of range.
        """
        return self._submit(Direction.D2H, pages, slot_offsets, keys, ready)

    def submit_recall(self, pages: PoolPageIds, slot_offsets: Indices,
                      keys: Sequence[bytes], ready: Ready | None = None) -> LaneJob:
        """Copy the arena at `slot_offsets[i]` into pool page `pages.page_ids[i]`.

        The job completes only once the bytes are in the pool (on CUDA: its event synchronized).

        Raises:
            ProtocolError: lists of different lengths, a page or slot out of range.
        """
        return self._submit(Direction.H2D, pages, slot_offsets, keys, ready)

    def _submit(self, direction: Direction, pages: PoolPageIds, slot_offsets: Indices,
                keys: Sequence[bytes], ready: Ready | None) -> LaneJob:
        if self._closed:
            raise ProtocolError("the transfer engine is closed")
        self.backend.check_pool(pages.pool)
        check_entries(pages, slot_offsets, keys, self.arena.nbytes)
        lane = self.lanes[direction]
        if not (ready is None or isinstance(ready, LaneJob) or callable(ready)
                or hasattr(ready, "is_set") or lane.mover.is_device_ready(ready)):
            raise ProtocolError(f"a {type(ready).__name__} cannot be a ready condition")
        job = LaneJob(direction, pages, slot_offsets, keys, ready)
        lane.submit(job)
        return job

    def rotate(self, swap_out: Swap, swap_in: Swap) -> Rotation:
        """Swap `swap_out` pages to the arena and `swap_in` pages from it, both lanes at once.

        A swap-in entry that writes a pool page being swapped out, or reads an arena slot being
        written, waits only for that one swap-out entry; every other entry starts at once. If the
        swap-out it waits on fails, it is not moved (and is reported failed).

        Raises:
            ProtocolError: as `submit_store` / `submit_recall`.
        """
        out_pool, in_pool = swap_out.pages.pool, swap_in.pages.pool
        out_ids = [int(p) for p in swap_out.pages.page_ids]
        out_slots = [int(s) for s in swap_out.slot_offsets]
        by_page = {page: i for i, page in enumerate(out_ids)} if out_pool is in_pool else {}
        by_slot = {slot: i for i, slot in enumerate(out_slots)}
        in_ids = [int(p) for p in swap_in.pages.page_ids]
        in_slots = [int(s) for s in swap_in.slot_offsets]
        depends_on: list[tuple[int, ...]] = []  # per swap-in entry: the swap-outs it waits on
        for page, slot in zip(in_ids, in_slots):
            waits = {i for i in (by_page.get(page), by_slot.get(slot)) if i is not None}
            depends_on.append(tuple(sorted(waits)))
        gating = sorted({i for deps in depends_on for i in deps})
        gating_set = set(gating)
        free = [i for i in range(len(out_ids)) if i not in gating_set]
        out_jobs: dict[int, LaneJob] = {}
        for i in gating:  # one job per gating slot: a swap-in waits for its own slot only
            out_jobs[i] = self.submit_store(PoolPageIds(out_pool, [out_ids[i]]), [out_slots[i]],
                                            [swap_out.keys[i]])
        swap_out_jobs = list(out_jobs.values())
        if free:
            swap_out_jobs.append(self._submit_subset(Direction.D2H, swap_out, free, None))
        groups: dict[tuple[int, ...], list[int]] = {}
        for index, deps in enumerate(depends_on):
            groups.setdefault(deps, []).append(index)
        swap_in_jobs = []
        for deps, indices in groups.items():
            ready: Ready | None = None
            if len(deps) == 1:
                ready = out_jobs[deps[0]]
            elif deps:
                waited = [out_jobs[i] for i in deps]
                ready = lambda waited=waited: all(job.done() for job in waited)  # noqa: E731
            swap_in_jobs.append(self._submit_subset(Direction.H2D, swap_in, indices, ready))
        return Rotation(swap_out_jobs, swap_in_jobs)

    def _submit_subset(self, direction: Direction, swap: Swap, indices: list[int],
                       ready: Ready | None) -> LaneJob:
        ids = np.asarray(swap.pages.page_ids, dtype=np.int64)[indices]
        slots = np.asarray(swap.slot_offsets, dtype=np.int64)[indices]
        return self._submit(direction, PoolPageIds(swap.pages.pool, ids), slots,
                            [swap.keys[i] for i in indices], ready)

    def lane_stats(self) -> dict[Direction, LaneStats]:
        """Ticks, bytes and busy seconds of each lane."""
        return {d: LaneStats(lane.num_ticks, lane.bytes_moved, lane.busy_s)
                for d, lane in self.lanes.items()}

    def close(self) -> None:
        """Finish queued jobs, stop both lanes, release the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for lane in self.lanes.values():
            lane.close()
        self.backend.close()

    def __enter__(self) -> DuplexLanes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
