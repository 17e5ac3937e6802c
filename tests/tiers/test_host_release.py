"""The host arena gives the memory of chunks left with no page back, and takes it again before
a chunk is carved anew (issue #24): the system has it back, not only the daemon's RSS."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.shm import SHM_DIR
from kvtier.tiers import host as host_module
from kvtier.tiers.host import HostTier
from kvtier.tiers.slots import SlabAllocator

CHUNK_BYTES = 1 << 20
SLOT_BYTES = 4096


@pytest.fixture
def host() -> Iterator[HostTier]:
    tier = HostTier(8 * CHUNK_BYTES, CHUNK_BYTES, prefault=False)
    yield tier
    tier.close()


def arena_file_bytes(host: HostTier) -> int:
    """Memory the arena's file holds in /dev/shm now."""
    assert host.segment is not None
    return os.stat(SHM_DIR / host.segment.name).st_blocks * 512


def fill_chunks(host: HostTier, num_chunks: int) -> list[int]:
    offsets = host.slots.alloc_many(SLOT_BYTES, num_chunks * CHUNK_BYTES // SLOT_BYTES)
    for offset in offsets:
        host.view(offset, SLOT_BYTES)[:] = 7
    return offsets


def test_an_emptied_chunk_gives_its_memory_back(host: HostTier) -> None:
    offsets = fill_chunks(host, 2)
    held_bytes = arena_file_bytes(host)
    assert not host.release_idle_chunk(), "a chunk in use was given back"
    for offset in offsets[: CHUNK_BYTES // SLOT_BYTES]:  # the first chunk's pages go
        host.slots.free(offset, SLOT_BYTES)
    assert host.release_idle_chunk()
    assert not host.release_idle_chunk(), "one emptied chunk was given back twice"
    assert arena_file_bytes(host) <= held_bytes - CHUNK_BYTES
    # The second chunk's pages are untouched.
    second = offsets[CHUNK_BYTES // SLOT_BYTES]
    assert (host.view(second, SLOT_BYTES) == 7).all()


def test_a_released_chunk_is_reserved_again_before_reuse(host: HostTier) -> None:
    offsets = fill_chunks(host, 8)
    for offset in offsets:
        host.slots.free(offset, SLOT_BYTES)
    while host.release_idle_chunk():
        pass
    released_bytes = arena_file_bytes(host)
    assert released_bytes <= CHUNK_BYTES // 2, "the emptied arena still holds its memory"
    again = host.slots.alloc_many(SLOT_BYTES, 8 * CHUNK_BYTES // SLOT_BYTES)
    assert len(again) == 8 * CHUNK_BYTES // SLOT_BYTES
    assert arena_file_bytes(host) >= 8 * CHUNK_BYTES - released_bytes
    rows = np.random.default_rng(0).integers(0, 256, (len(again), SLOT_BYTES), dtype=np.uint8)
    for offset, row in zip(again, rows, strict=True):
        host.view(offset, SLOT_BYTES)[:] = row
    assert all((host.view(o, SLOT_BYTES) == r).all() for o, r in zip(again, rows, strict=True))


def test_a_chunk_without_room_in_dev_shm_stays_unused(host: HostTier,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    offsets = fill_chunks(host, 8)
    for offset in offsets:
        host.slots.free(offset, SLOT_BYTES)
    assert host.release_idle_chunk()  # one of the eight

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(host_module.os, "posix_fallocate", no_room)
    got = host.slots.alloc_many(SLOT_BYTES, 8 * CHUNK_BYTES // SLOT_BYTES)
    assert len(got) < 8 * CHUNK_BYTES // SLOT_BYTES, "a chunk with no memory was handed out"
    monkeypatch.undo()
    rest = host.slots.alloc_many(SLOT_BYTES, 8 * CHUNK_BYTES // SLOT_BYTES)
    assert len(got) + len(rest) == 8 * CHUNK_BYTES // SLOT_BYTES


def test_the_allocator_reserves_only_chunks_it_handed_out_idle() -> None:
    reserved: list[int] = []
    slots = SlabAllocator(4 * CHUNK_BYTES, CHUNK_BYTES, 64,
                          lambda chunk_id: reserved.append(chunk_id) is None)
    assert slots.take_idle_chunk() is None, "a chunk never used is not idle"
    first = slots.alloc_many(SLOT_BYTES, CHUNK_BYTES // SLOT_BYTES)
    for offset in first:
        slots.free(offset, SLOT_BYTES)
    assert slots.take_idle_chunk() == 0
    assert slots.take_idle_chunk() is None
    slots.alloc_many(SLOT_BYTES, 2 * CHUNK_BYTES // SLOT_BYTES)
    assert reserved == [0], "only the chunk given back is reserved again, once"
    assert slots.take_idle_chunk() is None, "a chunk carved again is not idle"


def test_a_chunk_is_given_back_only_after_staying_empty_its_grace() -> None:
    """A delete followed by stores must not punch and fault the same memory again: only a chunk
    empty for `idle_for_s` is handed out, the one empty longest first."""
    now = [100.0]
    slots = SlabAllocator(4 * CHUNK_BYTES, CHUNK_BYTES, 64, lambda chunk_id: True,
                          clock=lambda: now[0])
    per_chunk = CHUNK_BYTES // SLOT_BYTES
    offsets = slots.alloc_many(SLOT_BYTES, 2 * per_chunk)
    for offset in offsets[per_chunk:]:  # chunk 1 empties first
        slots.free(offset, SLOT_BYTES)
    now[0] += 3.0
    for offset in offsets[:per_chunk]:  # chunk 0 three seconds later
        slots.free(offset, SLOT_BYTES)
    now[0] += 1.0
    assert slots.take_idle_chunk(idle_for_s=5.0) is None, "a chunk empty 4 s was given back"
    now[0] += 1.0
    assert slots.take_idle_chunk(idle_for_s=5.0) == 1, "the chunk empty 5 s was kept"
    assert slots.take_idle_chunk(idle_for_s=5.0) is None, "a chunk empty 2 s was given back"
    now[0] += 3.0
    assert slots.take_idle_chunk(idle_for_s=5.0) == 0
    # Carved again within its grace, a chunk is not idle any more, whatever its age then.
    again = slots.alloc_many(SLOT_BYTES, per_chunk)
    for offset in again:
        slots.free(offset, SLOT_BYTES)
    slots.alloc_many(SLOT_BYTES, per_chunk)
    now[0] += 60.0
    assert slots.take_idle_chunk(idle_for_s=5.0) is None, "a chunk in use was given back"
