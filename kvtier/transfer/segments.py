"""Flat segment lists for the gather/scatter kernels: one (pool address, arena offset, length)
per K or V segment of every page of a tick, adjacent segments merged, split into chunks that fit
one staging buffer.

Built with vectorised numpy (no per-segment Python), used by the CUDA backend and checked on the
CPU by applying the lists with numpy. Verbs: `plan_segments`, `split_chunks`, `cut_runs_at`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.transfer.jobs import LaneJob


@dataclass(slots=True, frozen=True)
class SegmentPlan:
    """Segment `s` moves `lengths[s]` bytes between pool address `pool_addrs[s]` and arena offset
    `arena_offsets[s]`; it belongs to page `entries[s]` of the tick (index into `owners`)."""

    pool_addrs: np.ndarray  # uint64
    arena_offsets: np.ndarray  # uint64
    lengths: np.ndarray  # uint64
    entries: np.ndarray  # int64, first tick entry each merged segment covers
    last_entries: np.ndarray  # int64, last tick entry each merged segment covers
    owners: list[tuple[LaneJob, int]]  # tick entry -> (job, page index in job)


def plan_segments(jobs: list[LaneJob], base_address: dict[int, int]) -> SegmentPlan:
    """Every segment of every page of `jobs`, merged where pool and arena are both contiguous.

    `base_address[id(job.pool)]` is the pool's address (device pointer, or 0 for offsets).
    """
    addrs, offsets, lengths, entries = [], [], [], []
    owners: list[tuple[LaneJob, int]] = []
    for job in jobs:
        layout = job.pool.layout
        segment = layout.segment_bytes
        layer = np.arange(layout.num_layers, dtype=np.int64)[:, None]
        kv = np.arange(2, dtype=np.int64)[None, :]
        pool_in_page = (layer * layout.layer_stride_bytes + kv * layout.kv_stride_bytes).ravel()
        arena_in_page = ((layer * 2 + kv) * segment).ravel()
        base = base_address[id(job.pool)] + layout.offset_bytes
        addrs.append((base + job.page_ids[:, None] * layout.page_stride_bytes
                      + pool_in_page[None, :]).ravel())
        offsets.append((job.slot_offsets[:, None] + arena_in_page[None, :]).ravel())
        lengths.append(np.full(job.num_pages * len(pool_in_page), segment, dtype=np.int64))
        entries.append(np.repeat(np.arange(len(owners), len(owners) + job.num_pages),
                                 len(pool_in_page)))
        owners.extend((job, index) for index in range(job.num_pages))
    if not owners:
        empty = np.empty(0, dtype=np.uint64)
        return SegmentPlan(empty, empty, empty, empty.astype(np.int64), empty.astype(np.int64), [])
    addr, offset, length, entry = (np.concatenate(a) for a in (addrs, offsets, lengths, entries))
    # Merge a segment into the previous one when both ends continue it (page-first pools, adjacent
    # slots): fewer, longer segments mean fewer thread blocks doing tail work.
    joins = (addr[1:] == addr[:-1] + length[:-1]) & (offset[1:] == offset[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    ends = np.concatenate((starts[1:], [len(addr)]))
    return SegmentPlan(addr[starts].astype(np.uint64), offset[starts].astype(np.uint64),
                       np.add.reduceat(length, starts).astype(np.uint64), entry[starts],
                       entry[ends - 1], owners)


def split_chunks(lengths: np.ndarray, chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of segments whose lengths sum to at most `chunk_bytes` each.

    Raises:
        ValueError: one segment alone is longer than `chunk_bytes` (cap merges at chunk size).
    """
    if len(lengths) and int(lengths.max()) > chunk_bytes:
        raise ValueError(f"a {int(lengths.max())}-byte segment exceeds the {chunk_bytes}-byte "
                         "staging buffer")
    # Greedy, vectorised: each chunk starts at the first segment that would overflow the one
    # before (a Python loop over a 16,384-segment tick cost 2 ms of a 12 ms copy on the GPU).
    ends = np.cumsum(lengths.astype(np.int64))
    chunks: list[tuple[int, int]] = []
    start, offset = 0, 0
    while start < len(lengths):
        stop = int(np.searchsorted(ends, offset + chunk_bytes, side="right"))
        chunks.append((start, stop))
        start, offset = stop, int(ends[stop - 1])
    return chunks


def cap_lengths(plan: SegmentPlan, max_bytes: int) -> SegmentPlan:
    """Split merged segments longer than `max_bytes` so each fits one staging buffer."""
    pieces = np.maximum(1, -(-plan.lengths.astype(np.int64) // max_bytes))
    if int(pieces.max(initial=1)) == 1:
        return plan
    index = np.repeat(np.arange(len(pieces)), pieces)
    within = np.arange(len(index)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    skip = (within * max_bytes).astype(np.uint64)
    lengths = np.minimum(plan.lengths[index] - skip, np.uint64(max_bytes))
    return SegmentPlan(plan.pool_addrs[index] + skip, plan.arena_offsets[index] + skip, lengths,
                       plan.entries[index], plan.last_entries[index], plan.owners)


def cut_runs_at(staged: np.ndarray, arena: np.ndarray, lengths: np.ndarray,
                bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(staging offset, arena offset, length) runs cut wherever one crosses an arena offset in
    `bounds` (sorted): one DMA may not span two host registrations (cudaErrorInvalidValue)."""
    staged, arena, lengths = (a.astype(np.int64) for a in (staged, arena, lengths))
    bounds = np.asarray(bounds, dtype=np.int64)
    crossed = (np.searchsorted(bounds, arena + lengths, side="left")
               > np.searchsorted(bounds, arena, side="right"))
    if not crossed.any():
        return staged, arena, lengths
    pieces: list[tuple[int, int, int]] = []
    for staged_at, arena_at, length in zip(staged.tolist(), arena.tolist(), lengths.tolist()):
        end = arena_at + length
        for bound in bounds[(bounds > arena_at) & (bounds < end)].tolist():
            pieces.append((staged_at, arena_at, bound - arena_at))
            staged_at, arena_at = staged_at + bound - arena_at, bound
        pieces.append((staged_at, arena_at, end - arena_at))
    cut = np.array(pieces, dtype=np.int64).reshape(-1, 3)
    return cut[:, 0], cut[:, 1], cut[:, 2]
