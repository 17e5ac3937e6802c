"""The CPU backend: numpy copies between shared-memory segments, what tests and CI run.

A tick's entries (pool page, arena slot) become runs: consecutive pages of one pool going to slots
a constant stride apart move as ONE strided `np.copyto` of `[count, layers, 2, segment]`, which
numpy walks in whole segments with the GIL released (so the two lanes really run in parallel).
One thread's copy stops at what one core drives, so a large batch is cut by pages into shares of
about equal bytes that the lane's thread and its helper threads copy at once (`SPLIT_PART_BYTES`):
engines' pages are scattered, so a tick is often many short runs.
When a run fails it is retried page by page, so exactly the pages that cannot move are reported.
A pool that is a client's `PoolFile` (the daemon's case) moves with preadv/pwritev on its
descriptor instead, never through a mapping: its client may shrink it mid-copy.
Verbs: `CpuBackend.open_mover`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ProtocolError
from kvtier.pools.layout import PoolMemory
from kvtier.pools.pool_file import CopyWay, PoolFile
from kvtier.transfer.jobs import Direction, LaneJob

# A batch of at least two shares of this many bytes is copied by several threads at once: one
# thread's copy of 64 pages of 1 MiB in 32 KiB segments (SGLang's page_first pool) runs at
# 9.3 GB/s on a 2-core machine, two threads' at 22 (numpy releases the GIL while it copies).
SPLIT_PART_BYTES = 4 << 20
# Threads copying one batch at most: more than a few do not raise a node's memory bandwidth.
MAX_COPY_THREADS = 4


def default_copy_threads() -> int:
    """Threads one lane copies a large batch with: the CPUs this process may run on, at most
    MAX_COPY_THREADS."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, MAX_COPY_THREADS))


@dataclass(slots=True)
class Run:
    """`count` consecutive pages of one pool from `first_page`, slots `slot_stride` apart."""

    pool: PoolMemory
    first_page: int
    first_slot: int
    slot_stride: int
    count: int
    owners: list[tuple[LaneJob, int]]  # (job, page index in job) per page of the run


def plan_runs(jobs: list[LaneJob]) -> list[Run]:
    """Group the tick's pages, in submission order, into runs of adjacent pages and slots."""
    runs: list[Run] = []
    last: Run | None = None
    for job in jobs:
        page_bytes = job.pool.layout.page_bytes
        for index, (page, slot) in enumerate(zip(job.page_ids.tolist(), job.slot_offsets.tolist())):
            if last is not None and last.pool is job.pool and page == last.first_page + last.count:
                stride = slot - last.first_slot if last.count == 1 else last.slot_stride
                if stride >= page_bytes and slot == last.first_slot + last.count * stride:
                    last.slot_stride = stride
                    last.count += 1
                    last.owners.append((job, index))
                    continue
            last = Run(job.pool, page, slot, page_bytes, 1, [(job, index)])
            runs.append(last)
    return runs


Share = list[tuple[int, int, int]]  # (run number, first page in the run, page count) parts


def cut_shares(runs: list[Run], num_shares: int) -> list[Share]:
    """The runs' pages cut into `num_shares` shares of about equal bytes, in run order; a run
    crossing a share's end is cut between two pages (some shares stay empty when a page is
    larger than a share)."""
    total = sum(run.count * run.pool.layout.page_bytes for run in runs)
    shares: list[Share] = [[] for _ in range(num_shares)]
    share = filled = 0
    for number, run in enumerate(runs):
        page_bytes = run.pool.layout.page_bytes
        start = 0
        while start < run.count:
            share_end = total * (share + 1) // num_shares
            if filled >= share_end and share < num_shares - 1:
                share += 1
                continue
            take = run.count - start
            if share < num_shares - 1:
                take = min(take, -(-(share_end - filled) // page_bytes))
            shares[share].append((number, start, take))
            start += take
            filled += take * page_bytes
    return shares


class CpuMover:
    """Moves one direction's batches with numpy on the lane's own thread; a large batch is cut
    into shares copied at once by that thread and `copy_threads - 1` helper threads of this
    lane's own (the other lane's copies never queue behind them)."""

    def __init__(self, direction: Direction, arena: np.ndarray, copy_threads: int = 1) -> None:
        self.direction = direction
        self.arena = arena
        self._arena_bytes = arena.data.cast("B")
        self._file_way = CopyWay.OUT_OF_POOL if direction is Direction.D2H else CopyWay.INTO_POOL
        self._views: dict[int, tuple[PoolMemory, np.ndarray]] = {}
        self._copy_threads = copy_threads
        self._helpers = (ThreadPoolExecutor(copy_threads - 1,
                                            thread_name_prefix=f"kvtier-copy-{direction.value}")
                         if copy_threads > 1 else None)

    def is_device_ready(self, ready: object) -> bool:
        """The CPU backend has no device-side conditions."""
        return False

    def move(self, jobs: list[LaneJob]) -> None:
        """Copy every run of the batch; finish each job naming the pages that failed."""
        runs = plan_runs(jobs)
        # the tick's bytes from its jobs (a few), not its runs (up to a run a page)
        total = sum(job.num_pages * job.pool.layout.page_bytes for job in jobs)
        num_shares = min(self._copy_threads, total // SPLIT_PART_BYTES)
        if num_shares >= 2:
            self._move_in_shares(jobs, runs, num_shares)
        else:
            self._move_in_order(jobs, runs)
        self._views.clear()  # per tick: a pool unregistered later must not stay mapped here

    def _move_in_order(self, jobs: list[LaneJob], runs: list[Run]) -> None:
        failures: dict[int, list[int]] = {}
        reasons: dict[int, str] = {}
        # Finish each job right after the run holding its last page: a rotate's swap-in of a slot
        # starts as soon as that slot's swap-out landed, not at the end of the tick.
        finishing: dict[int, list[LaneJob]] = {}
        for number, run in enumerate(runs):
            for job, index in run.owners:
                if index == job.num_pages - 1:
                    finishing.setdefault(number, []).append(job)
        for number, run in enumerate(runs):
            for job, index, reason in self._move_run(run):
                failures.setdefault(id(job), []).append(index)
                reasons.setdefault(id(job), reason)
            for job in finishing.get(number, ()):
                job.finish(failures.get(id(job), ()), reasons.get(id(job), ""))
        for job in jobs:
            if job.num_pages == 0:
                job.finish()

    def _move_in_shares(self, jobs: list[LaneJob], runs: list[Run], num_shares: int) -> None:
        """Every share at once, then the runs with a failed part page by page; the jobs finish
        together at the end (a share holds parts of many jobs)."""
        assert self._helpers is not None
        shares = cut_shares(runs, num_shares)
        helped = [self._helpers.submit(self._copy_share, runs, share)
                  for share in shares[1:] if share]
        failed_runs = self._copy_share(runs, shares[0])
        for share_failed in helped:
            failed_runs |= share_failed.result()  # `_copy_share` raises nothing
        failures: dict[int, list[int]] = {}
        reasons: dict[int, str] = {}
        for number in sorted(failed_runs):
            for job, index, reason in self._move_pages(runs[number]):
                failures.setdefault(id(job), []).append(index)
                reasons.setdefault(id(job), reason)
        for job in jobs:
            job.finish(failures.get(id(job), ()), reasons.get(id(job), ""))

    def _copy_share(self, runs: list[Run], share: Share) -> set[int]:
        """Copy each part of `share`; the numbers of the runs whose part failed."""
        failed: set[int] = set()
        for number, start, count in share:
            run = runs[number]
            try:
                self._copy(run.pool, run.first_page + start,
                           run.first_slot + start * run.slot_stride, run.slot_stride, count)
            except Exception:  # the run is retried page by page, which names the error
                failed.add(number)
        return failed

    def _move_run(self, run: Run) -> Iterator[tuple[LaneJob, int, str]]:
        """Fast path: the run as one copy. Slow path after a failure: page by page."""
        try:
            self._copy(run.pool, run.first_page, run.first_slot, run.slot_stride, run.count)
            return
        except Exception as exc:  # reported per page below, never swallowed
            if run.count == 1:
                job, index = run.owners[0]
                yield job, index, f"{type(exc).__name__}: {exc}"
                return
        yield from self._move_pages(run)

    def _move_pages(self, run: Run) -> Iterator[tuple[LaneJob, int, str]]:
        """The run page by page: each page that cannot move, with its error."""
        for offset, (job, index) in enumerate(run.owners):
            try:
                self._copy(run.pool, run.first_page + offset,
                           run.first_slot + offset * run.slot_stride, run.slot_stride, 1)
            except Exception as exc:
                yield job, index, f"{type(exc).__name__}: {exc}"

    def _copy(self, pool: PoolMemory, first_page: int, first_slot: int, slot_stride: int,
              count: int) -> None:
        """One strided copy of `count` pages between the pool and the arena."""
        layout = pool.layout
        if isinstance(pool.base, PoolFile):
            pool.base.copy_pages(self._file_way, layout, first_page, count, self._arena_bytes,
                                 first_slot, slot_stride)
            return
        pages = self._pool_view(pool)[first_page : first_page + count]
        segment = layout.segment_bytes
        slots = np.lib.stride_tricks.as_strided(
            self.arena[first_slot:], shape=pages.shape,
            strides=(slot_stride, 2 * segment, segment, 1))
        if self.direction is Direction.D2H:
            np.copyto(slots, pages)
        else:
            np.copyto(pages, slots)

    def _pool_view(self, pool: PoolMemory) -> np.ndarray:
        cached = self._views.get(id(pool))
        if cached is None:  # once per pool per tick: page_view costs µs, a tick has many runs
            base = pool.base
            assert isinstance(base, np.ndarray)  # check_pool admits arrays and PoolFiles only
            cached = self._views[id(pool)] = (pool, pool.layout.page_view(base))
        return cached[1]

    def close(self) -> None:
        """Drop cached pool views; stop the helper threads."""
        self._views.clear()
        if self._helpers is not None:
            self._helpers.shutdown()


class CpuBackend:
    """Numpy copies on each lane's thread (and its helpers); no device, no staging.

    Args:
        copy_threads: threads that copy one large batch at once, per lane (default
            `default_copy_threads()`; 1: the lane's thread alone).
    """

    name = "cpu"

    def __init__(self, copy_threads: int | None = None) -> None:
        self.copy_threads = default_copy_threads() if copy_threads is None else copy_threads
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads must be at least 1, got {self.copy_threads}")

    def open_mover(self, direction: Direction, arena: np.ndarray) -> CpuMover:
        """The mover of one lane over the host arena `arena` (a flat uint8 array)."""
        return CpuMover(direction, arena, self.copy_threads)

    def check_pool(self, pool: PoolMemory) -> None:
        """Reject a pool this backend cannot address.

        Raises:
            ProtocolError: the pool is not a flat uint8 numpy array (or a `PoolFile`) large
                enough for its layout.
        """
        base = pool.base
        if isinstance(base, PoolFile):
            pool.layout.validate(base.size_bytes)
            return
        if not isinstance(base, np.ndarray) or base.dtype != np.uint8 or base.ndim != 1:
            raise ProtocolError("the CPU transfer backend needs each pool as a flat uint8 array")
        pool.layout.validate(base.nbytes)

    def close(self) -> None:
        """Nothing to release."""
