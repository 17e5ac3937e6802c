"""SlabAllocator: exact capacity, no overlap, chunk reuse across slot sizes, recovery claims."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import CapacityError
from kvtier.tiers.slots import SlabAllocator, align_up


def check_model(alloc: SlabAllocator, live: dict[int, int]) -> None:
    """The allocator's totals match `live` (offset -> slot bytes) and no two slots overlap."""
    assert alloc.num_used == len(live)
    assert alloc.used_bytes == sum(live.values())
    assert alloc.used_bytes <= alloc.capacity_bytes
    end = 0
    for offset in sorted(live):
        assert offset >= end, f"slot {offset} overlaps the slot before it"
        assert offset % alloc.alignment == 0
        # A slot never straddles two chunks.
        assert offset // alloc.chunk_bytes == (offset + live[offset] - 1) // alloc.chunk_bytes
        end = offset + live[offset]
    assert end <= alloc.capacity_bytes


def test_align_up() -> None:
    assert [align_up(v, 64) for v in (0, 1, 63, 64, 65, 128)] == [0, 64, 64, 64, 128, 128]


def test_capacity_rounds_down_to_whole_chunks() -> None:
    alloc = SlabAllocator(capacity_bytes=10_000, chunk_bytes=4096, alignment=64)
    assert (alloc.num_chunks, alloc.capacity_bytes, alloc.chunk_bytes) == (2, 8192, 4096)


def test_chunk_clipped_to_capacity_and_alignment() -> None:
    alloc = SlabAllocator(capacity_bytes=5000, chunk_bytes=1 << 20, alignment=4096)
    assert (alloc.chunk_bytes, alloc.capacity_bytes) == (4096, 4096)


def test_capacity_below_one_aligned_chunk_raises() -> None:
    with pytest.raises(CapacityError, match="too small"):
        SlabAllocator(capacity_bytes=4000, chunk_bytes=4000, alignment=4096)


@pytest.mark.parametrize("slot_bytes", [64, 192, 1000, 4096])
def test_fills_exactly_capacity_and_never_more(slot_bytes: int) -> None:
    alloc = SlabAllocator(capacity_bytes=4 * 4096, chunk_bytes=4096, alignment=64)
    slot_bytes = alloc.slot_bytes_for(slot_bytes)
    per_chunk = 4096 // slot_bytes
    live: dict[int, int] = {}
    while (offset := alloc.try_alloc(slot_bytes)) is not None:
        assert offset not in live
        live[offset] = slot_bytes
    assert len(live) == 4 * per_chunk
    assert not alloc.can_hold(slot_bytes)
    assert alloc.try_alloc(slot_bytes) is None
    check_model(alloc, live)
    if 4096 % slot_bytes == 0:
        assert alloc.used_bytes == alloc.capacity_bytes


def test_fresh_allocator_fills_the_range_in_order() -> None:
    alloc = SlabAllocator(capacity_bytes=3 * 4096, chunk_bytes=4096, alignment=64)
    offsets = [alloc.try_alloc(2048) for _ in range(6)]
    assert offsets == [0, 2048, 4096, 6144, 8192, 10240]


def test_slot_bytes_for_rounds_to_alignment_and_rejects_oversize() -> None:
    alloc = SlabAllocator(capacity_bytes=8 * 8192, chunk_bytes=8192, alignment=4096)
    assert alloc.slot_bytes_for(1) == 4096
    assert alloc.slot_bytes_for(4096 + 64) == 8192
    assert alloc.slot_bytes_for(8192) == 8192
    with pytest.raises(CapacityError, match="does not fit a 8192-byte chunk"):
        alloc.slot_bytes_for(8193)


def test_emptied_chunk_returns_and_is_recarved_with_another_size() -> None:
    alloc = SlabAllocator(capacity_bytes=2 * 4096, chunk_bytes=4096, alignment=64)
    small = [alloc.try_alloc(1024) for _ in range(8)]
    assert None not in small and alloc.try_alloc(1024) is None
    assert alloc.try_alloc(4096) is None  # every chunk is carved into 1 KiB slots
    for offset in small[:4]:  # empties chunk 0
        alloc.free(offset, 1024)
    assert alloc.can_hold(4096)
    assert alloc.try_alloc(4096) == 0
    assert alloc.try_alloc(4096) is None
    check_model(alloc, {0: 4096, **{o: 1024 for o in small[4:]}})
    for offset in small[4:]:
        alloc.free(offset, 1024)
    alloc.free(0, 4096)
    assert (alloc.used_bytes, alloc.num_used) == (0, 0)
    assert [alloc.try_alloc(4096), alloc.try_alloc(4096)] == [0, 4096]


def test_freed_slot_is_reused_before_a_new_chunk() -> None:
    alloc = SlabAllocator(capacity_bytes=4 * 4096, chunk_bytes=4096, alignment=64)
    first = [alloc.try_alloc(1024) for _ in range(3)]
    alloc.free(first[1], 1024)
    assert alloc.try_alloc(1024) == first[1]
    assert alloc.try_alloc(1024) == 3072  # then the chunk's last bump slot
    assert alloc.try_alloc(1024) == 4096  # only then a new chunk


@pytest.mark.parametrize("freed_in", ["address order", "reverse address order"])
def test_a_batch_of_reused_slots_comes_in_address_order(freed_in: str) -> None:
    """Slots freed together (a request's pages deleted in key order, or evicted deepest first)
    are reused in address order by the next batch: its pages stay one run, one copy."""
    alloc = SlabAllocator(capacity_bytes=64 * 1024, chunk_bytes=64 * 1024, alignment=64)
    first, kept = alloc.alloc_many(1024, 8), alloc.alloc_many(1024, 8)
    for offset in first if freed_in == "address order" else reversed(first):
        alloc.free(offset, 1024)
    assert alloc.alloc_many(1024, 8) == first
    assert kept == list(range(8 * 1024, 16 * 1024, 1024))


@pytest.mark.parametrize("seed", range(6))
def test_random_alloc_free_with_two_sizes_matches_a_model(seed: int) -> None:
    rng = np.random.default_rng(seed)
    alloc = SlabAllocator(capacity_bytes=16 * 8192, chunk_bytes=8192, alignment=64)
    sizes = (alloc.slot_bytes_for(1000), alloc.slot_bytes_for(2700))  # 1024 and 2752
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            offset = list(live)[rng.integers(len(live))]
            alloc.free(offset, live.pop(offset))
        else:
            size = sizes[rng.integers(2)]
            can_hold = alloc.can_hold(size)
            offset = alloc.try_alloc(size)
            assert (offset is not None) == can_hold
            if offset is not None:
                assert offset not in live
                live[offset] = size
        check_model(alloc, live)
    for offset, size in list(live.items()):
        alloc.free(offset, size)
    check_model(alloc, {})
    # Everything back in free chunks: the whole range is usable by a third size.
    assert sorted(alloc.try_alloc(8192) for _ in range(16)) == [i * 8192 for i in range(16)]
    assert alloc.try_alloc(8192) is None


def test_claim_marks_slots_used_and_later_allocs_avoid_them() -> None:
    alloc = SlabAllocator(capacity_bytes=4 * 4096, chunk_bytes=4096, alignment=64)
    claimed = {1024: 1024, 3072: 1024, 8192 + 2048: 2048}
    for offset, size in claimed.items():
        assert alloc.claim(offset, size)
    live = dict(claimed)
    check_model(alloc, live)
    while (offset := alloc.try_alloc(1024)) is not None:
        assert offset not in live
        live[offset] = 1024
        check_model(alloc, live)
    while (offset := alloc.try_alloc(2048)) is not None:
        assert offset not in live
        live[offset] = 2048
        check_model(alloc, live)
    # Chunk 0: 0 and 2048 filled around the claims; chunk 1 is 1 KiB; chunk 2 has 8192 free.
    assert sorted(o for o, s in live.items() if s == 1024) == [0, 1024, 2048, 3072,
                                                             4096, 5120, 6144, 7168,
                                                             12288, 13312, 14336, 15360]
    assert sorted(o for o, s in live.items() if s == 2048) == [8192, 10240]


def test_claim_rejects_collision_out_of_range_misaligned_and_size_clash() -> None:
    alloc = SlabAllocator(capacity_bytes=2 * 4096, chunk_bytes=4096, alignment=64)
    assert alloc.claim(2048, 1024)
    assert not alloc.claim(2048, 1024)  # collision with a claim
    taken = alloc.try_alloc(1024)
    assert taken is not None and taken != 2048
    assert not alloc.claim(taken, 1024)  # collision with an allocation
    assert not alloc.claim(8192, 1024)  # beyond the range
    assert not alloc.claim(1 << 40, 1024)
    assert not alloc.claim(512, 1024)  # misaligned for the slot size
    assert not alloc.claim(3500, 1024)
    assert not alloc.claim(0, 2048)  # chunk 0 is carved into 1 KiB slots
    assert not alloc.claim(4096 + 3072, 2048)  # would straddle the chunk end
    check_model(alloc, {2048: 1024, taken: 1024})


def test_claimed_then_freed_slot_can_be_allocated_again() -> None:
    alloc = SlabAllocator(capacity_bytes=4096, chunk_bytes=4096, alignment=64)
    assert alloc.claim(3072, 1024)
    alloc.free(3072, 1024)
    assert (alloc.used_bytes, alloc.num_used) == (0, 0)
    assert alloc.try_alloc(4096) == 0  # the chunk returned to the free chunks


def test_claim_of_last_slot_leaves_skipped_slots_allocatable() -> None:
    alloc = SlabAllocator(capacity_bytes=4096, chunk_bytes=4096, alignment=64)
    assert alloc.claim(3072, 1024)
    got = sorted(alloc.try_alloc(1024) for _ in range(3))
    assert got == [0, 1024, 2048]
    assert alloc.try_alloc(1024) is None
    check_model(alloc, {0: 1024, 1024: 1024, 2048: 1024, 3072: 1024})
