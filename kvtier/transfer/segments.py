"""Flat segment lists for the gather/scatter kernels: one (pool address, arena offset, length)
per K or V segment of every page of a tick, adjacent segments merged, split into chunks that fit
one staging buffer.

Built with vectorised numpy (no per-segment Python), used by the CUDA backend and checked on the
CPU by applying the lists with numpy. Verbs: `plan_segments`, `split_chunks`.
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
    chunks = []
    start, filled = 0, 0
    for index, length in enumerate(lengths.tolist()):
        if filled + length > chunk_bytes:
            chunks.append((start, index))
            start, filled = index, 0
        filled += length
    if start < len(lengths):
        chunks.append((start, len(lengths)))
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
