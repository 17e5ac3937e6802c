"""Slot allocation over a fixed byte range: the host arena and the disk slot file share it.

The range is cut into equal chunks; a chunk, when first needed, is carved into slots of one size
(one size per namespace page size) and returns to the free chunks once its last slot is freed, so
namespaces with different page sizes share one capacity without fragmenting it. Every operation is
O(1) for alloc and free. Capacity is the range itself: allocation never hands out a byte beyond it.

A tier holds at least `MIN_CHUNKS_PER_TIER` chunks where it can (`fit_chunk_bytes`): a new page
size takes a whole chunk, and a tier of one chunk would evict every page of the others for it.

A chunk that empties is idle until carved again; `take_idle_chunk` hands one out that has stayed
idle long enough so its owner can give its memory back (the host arena punches it out of
/dev/shm), and the allocator then calls `reserve_chunk` before carving that chunk again (the host
arena allocates its memory anew, and a chunk it cannot have stays unused): one dict operation
when a chunk empties or is taken, nothing per slot.

Verbs: `try_alloc`, `alloc_many`, `free`, `claim` (re-mark a slot in use during recovery),
`can_hold`, `chunk_of`, `take_idle_chunk`; `fit_chunk_bytes` sizes chunks for a tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.errors import CapacityError

# A tier cut into fewer chunks than this gets smaller chunks, so a page size moving in costs at
# most this share of the tier; never below MIN_FITTED_CHUNK_BYTES (nor above what was asked).
MIN_CHUNKS_PER_TIER = 16
MIN_FITTED_CHUNK_BYTES = 64 << 10


def fit_chunk_bytes(capacity_bytes: int, chunk_bytes: int, alignment: int) -> int:
    """The chunk size a tier of `capacity_bytes` uses when `chunk_bytes` is asked for.

    Lowered (to a multiple of `alignment`) so the tier holds `MIN_CHUNKS_PER_TIER` chunks, but
    not below `MIN_FITTED_CHUNK_BYTES`: a chunk asked for at or below that is kept as it is.
    """
    wanted = max(capacity_bytes // MIN_CHUNKS_PER_TIER, MIN_FITTED_CHUNK_BYTES)
    fitted = min(chunk_bytes, wanted, capacity_bytes)
    return max(fitted - fitted % alignment, alignment)


def align_up(value: int, alignment: int) -> int:
    """Round `value` up to a multiple of `alignment`."""
    return -(-value // alignment) * alignment


@dataclass(slots=True)
class _Chunk:
    slot_bytes: int = 0  # 0: not carved
    num_used: int = 0
    num_carved: int = 0  # slots handed out so far by the bump pointer
    free_offsets: list[int] = field(default_factory=list)


class SlabAllocator:
    """Hands out fixed-size slots (byte offsets) from `capacity_bytes`, chunk by chunk.

    Args:
        capacity_bytes: size of the range; rounded down to whole chunks.
        chunk_bytes: size of one chunk; a slot may not be larger. Clipped to the capacity.
        alignment: every slot size is rounded up to this (4096 for O_DIRECT files).
        reserve_chunk: called with a chunk id before a chunk handed out by `take_idle_chunk` is
            carved again; False leaves the chunk unused (no memory for it).
        clock: monotonic seconds, when a chunk emptied (injectable for tests).
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int, alignment: int = 64,
                 reserve_chunk: Callable[[int], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        chunk_bytes = min(chunk_bytes, capacity_bytes)
        chunk_bytes -= chunk_bytes % alignment
        if chunk_bytes <= 0:
            raise CapacityError(f"capacity {capacity_bytes} bytes is too small for one slot")
        self.chunk_bytes = chunk_bytes
        self.alignment = alignment
        self.num_chunks = capacity_bytes // chunk_bytes
        self.capacity_bytes = self.num_chunks * chunk_bytes
        self.used_bytes = 0
        self.num_used = 0
        self._chunks = [_Chunk() for _ in range(self.num_chunks)]
        # Free chunks as a stack (lowest index on top) so a fresh store fills the range in order.
        self._free_chunk_ids = list(range(self.num_chunks - 1, -1, -1))
        self._chunk_ids_with_room: dict[int, set[int]] = {}
        self._reserve_chunk = reserve_chunk
        self._clock = clock
        # Emptied, not carved since, memory still held: chunk id -> when it emptied, oldest first.
        self._idle_chunk_ids: dict[int, float] = {}
        self._released_chunk_ids: set[int] = set()  # taken by take_idle_chunk, not reserved since

    def slot_bytes_for(self, payload_bytes: int) -> int:
        """Size of the slot that holds `payload_bytes`.

        Raises:
            CapacityError: the slot would not fit in one chunk.
        """
        slot_bytes = align_up(payload_bytes, self.alignment)
        if slot_bytes > self.chunk_bytes:
            raise CapacityError(
                f"a {slot_bytes}-byte slot does not fit a {self.chunk_bytes}-byte chunk; "
                f"raise chunk_bytes (and the capacity) or use smaller pages"
            )
        return slot_bytes

    def chunk_of(self, offset: int) -> int:
        """The chunk the slot at `offset` lies in."""
        return offset // self.chunk_bytes

    def carved_offsets(self, chunk_id: int) -> range:
        """The offsets of the slots chunk `chunk_id` has carved so far, used or free."""
        chunk = self._chunks[chunk_id]
        base = chunk_id * self.chunk_bytes
        return range(base, base + chunk.num_carved * chunk.slot_bytes, chunk.slot_bytes or 1)

    def num_used_in(self, chunk_id: int) -> int:
        """How many slots of chunk `chunk_id` are in use."""
        return self._chunks[chunk_id].num_used

    def can_hold(self, slot_bytes: int) -> bool:
        """Whether `try_alloc(slot_bytes)` would succeed now."""
        return bool(self._chunk_ids_with_room.get(slot_bytes)) or bool(self._free_chunk_ids)

    def try_alloc(self, slot_bytes: int) -> int | None:
        """Return the offset of a free slot of `slot_bytes`, or None when there is no room."""
        offsets = self.alloc_many(slot_bytes, 1)
        return offsets[0] if offsets else None

    def alloc_many(self, slot_bytes: int, count: int) -> list[int]:
        """Up to `count` free slots of `slot_bytes` (fewer when the range runs out).

        Fresh slots come from a chunk's bump pointer in address order, and reused ones are
        handed out in address order too, so a batch of pages gets adjacent slots where they are
        free together and can later move as one copy.
        """
        offsets: list[int] = []
        with_room = self._chunk_ids_with_room.setdefault(slot_bytes, set())
        slots_per_chunk = self.chunk_bytes // slot_bytes
        while len(offsets) < count:
            if with_room:
                chunk_id = next(iter(with_room))
            elif self._free_chunk_ids:
                chunk_id = self._free_chunk_ids.pop()
                if not self._take_free_chunk(chunk_id):
                    self._free_chunk_ids.insert(0, chunk_id)  # the others go first next time
                    break
                self._chunks[chunk_id].slot_bytes = slot_bytes
                with_room.add(chunk_id)
            else:
                break
            chunk = self._chunks[chunk_id]
            wanted = count - len(offsets)
            reused = chunk.free_offsets[-wanted:]  # the last freed first
            del chunk.free_offsets[len(chunk.free_offsets) - len(reused):]
            # In address order: slots freed together (a request's pages, deleted in key order
            # or evicted deepest first) stay one run for the batch that reuses them.
            offsets += sorted(reused)
            num_fresh = min(wanted - len(reused), slots_per_chunk - chunk.num_carved)
            base = chunk_id * self.chunk_bytes + chunk.num_carved * slot_bytes
            offsets += range(base, base + num_fresh * slot_bytes, slot_bytes)
            chunk.num_carved += num_fresh
            chunk.num_used += len(reused) + num_fresh
            if not chunk.free_offsets and chunk.num_carved == slots_per_chunk:
                with_room.discard(chunk_id)
        self.used_bytes += len(offsets) * slot_bytes
        self.num_used += len(offsets)
        return offsets

    def free(self, offset: int, slot_bytes: int) -> None:
        """Return the slot at `offset` (of `slot_bytes`) to the free space."""
        chunk_id = offset // self.chunk_bytes
        chunk = self._chunks[chunk_id]
        assert chunk.slot_bytes == slot_bytes and chunk.num_used > 0, "double or foreign free"
        chunk.num_used -= 1
        self.used_bytes -= slot_bytes
        self.num_used -= 1
        if chunk.num_used == 0:
            self._chunk_ids_with_room[slot_bytes].discard(chunk_id)
            self._chunks[chunk_id] = _Chunk()
            self._free_chunk_ids.append(chunk_id)
            self._idle_chunk_ids[chunk_id] = self._clock()
        else:
            chunk.free_offsets.append(offset)
            self._chunk_ids_with_room[slot_bytes].add(chunk_id)

    def claim(self, offset: int, slot_bytes: int) -> bool:
        """Mark the slot at `offset` in use (recovery from a persisted index).

        Returns False, claiming nothing, when the slot does not fit the range, is misaligned for its
        chunk's slot size, or collides with a slot already claimed.
        """
        chunk_id, within = divmod(offset, self.chunk_bytes)
        if (chunk_id >= self.num_chunks or within % slot_bytes
                or within + slot_bytes > self.chunk_bytes):
            return False
        chunk = self._chunks[chunk_id]
        if chunk.slot_bytes not in (0, slot_bytes):
            return False
        if chunk.slot_bytes == 0:
            if not self._take_free_chunk(chunk_id):
                return False
            self._free_chunk_ids.remove(chunk_id)
            chunk.slot_bytes = slot_bytes
        index = within // slot_bytes
        base = chunk_id * self.chunk_bytes
        if index < chunk.num_carved:
            if offset not in chunk.free_offsets:
                return False
            chunk.free_offsets.remove(offset)
        else:
            # Slots skipped over by the bump pointer become free slots of this chunk.
            chunk.free_offsets.extend(
                base + i * slot_bytes for i in range(chunk.num_carved, index)
            )
            chunk.num_carved = index + 1
        chunk.num_used += 1
        with_room = self._chunk_ids_with_room.setdefault(slot_bytes, set())
        if chunk.free_offsets or (chunk.num_carved + 1) * slot_bytes <= self.chunk_bytes:
            with_room.add(chunk_id)
        else:
            with_room.discard(chunk_id)
        self.used_bytes += slot_bytes
        self.num_used += 1
        return True

    def take_idle_chunk(self, idle_for_s: float = 0.0) -> int | None:
        """A free chunk that held slots since it was last taken and has stayed empty for at
        least `idle_for_s`, for its owner to give its memory back (it is reserved again before
        its next use), or None."""
        # Insertion order is emptying order (a chunk carved again leaves the dict): the first is
        # the one idle longest.
        chunk_id = next(iter(self._idle_chunk_ids), None)
        if chunk_id is None or self._idle_chunk_ids[chunk_id] > self._clock() - idle_for_s:
            return None
        del self._idle_chunk_ids[chunk_id]
        if self._reserve_chunk is not None:
            self._released_chunk_ids.add(chunk_id)
        return chunk_id

    def _take_free_chunk(self, chunk_id: int) -> bool:
        """Whether free chunk `chunk_id` may be carved: reserved again if it was given back."""
        self._idle_chunk_ids.pop(chunk_id, None)
        if chunk_id not in self._released_chunk_ids:
            return True
        assert self._reserve_chunk is not None
        if not self._reserve_chunk(chunk_id):
            return False
        self._released_chunk_ids.discard(chunk_id)
        return True
