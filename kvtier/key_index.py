"""The lookup plane's shared-memory key index: its layout, its one writer and its readers.

The daemon publishes, per namespace, the keys it holds in a segment that clients map read-only,
so a lookup needs no round trip. The segment is an open-addressing table of 16-byte keys in
groups of `GROUP_SLOTS` slots (a key's home group is its first 8 bytes, little-endian, modulo
the number of groups; a full group spills into the next). An all-zero slot is empty, an all-0xff
slot a deleted key (a tombstone: probes go on past it); keys equal to either are never
published (a lookup of one may count it held: its recall then finds it missing, as for any page
gone since the lookup; hashed keys never take these values).

Readers never lock. The writer (one thread: the daemon's, under its store's lock) makes every
slot write odd-then-even on two counters, seqlock style: the group's version and the segment's
`write_seq`. A reader that sees `write_seq` even and unchanged across its whole lookup saw no
write at all (the fast path, no per-group check); otherwise it re-reads each group's version
around the group and trusts only groups it read whole. So a reader never sees a torn key, and a
hit is a key that was published when it was read. Stale answers err only towards a page gone at
recall time: a key is published once its page is READY and unpublished when it leaves its last
tier, and recall goes by key, so it can never yield another page's bytes. Loads and stores are
taken to be ordered as on x86-64 (TSO): numpy's gathers and the writer's stores run in program
order there.

The daemon also keeps `alive_until_ns` (CLOCK_MONOTONIC, shared by every process of the machine)
a little ahead of now while it runs: a reader past it stops answering, so the index of a daemon
that was killed (and could not retire it) sends its clients back to the socket, which tells them.

When the table fills (live keys and tombstones over `MAX_LOAD` of the slots) the writer's owner
builds a new segment sized for the live keys (`rebuild_groups`), with the next generation, and
then sets the old one's `retired` word: a reader that sees it asks the daemon for the new one.

Verbs: `SegmentLayout.for_groups` / `from_header`, `IndexWriter.insert` / `remove` / `needs_rebuild`
/ `retire`, `IndexReader.longest_prefix`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAGIC = 0x3130584449544B56  # b"VKTIDX01", little-endian
KEY_BYTES = 16
GROUP_SLOTS = 8
INDEX_HEADER_BYTES = 64
EMPTY_KEY = bytes(KEY_BYTES)
DELETED_KEY = b"\xff" * KEY_BYTES
MIN_GROUPS = 16
# Live keys + tombstones over this share of the slots: rebuild. A rebuild sizes the new table so
# the live keys fill `REBUILD_LOAD` of it: 17 bytes a slot (key + an eighth of its group's
# version) are 21.3-30.9 bytes a held page across the fill cycle (<= 32).
MAX_LOAD = 0.8
REBUILD_LOAD = 0.55
_MAX_READ_TRIES = 3  # a lookup torn by writes this many times is answered by the socket
# The daemon beats every BEAT_S; a reader trusts the index for ALIVE_NS past the last beat. A
# daemon too busy to beat in time costs its clients a round trip, never a wrong answer.
BEAT_S = 0.01
ALIVE_NS = 100_000_000

# Header words (uint64).
_MAGIC, _GENERATION, _RETIRED, _WRITE_SEQ, _NUM_GROUPS, _ALIVE_UNTIL_NS = range(6)
_FINGERPRINT_OFFSET = 48  # 16 bytes: the namespace's fingerprint
_KEY_DTYPE = np.dtype("V16")
_EMPTY = np.frombuffer(EMPTY_KEY, _KEY_DTYPE)


@dataclass(slots=True, frozen=True)
class SegmentLayout:
    """Where the parts of an index segment of `num_groups` groups lie."""

    num_groups: int
    versions_offset: int
    slots_offset: int
    size_bytes: int

    @classmethod
    def for_groups(cls, num_groups: int) -> SegmentLayout:
        """The layout of a segment of `num_groups` groups (>= 1)."""
        versions_bytes = -(-num_groups * 8 // 64) * 64  # a uint64 per group: never wraps
        slots_offset = INDEX_HEADER_BYTES + versions_bytes
        size = slots_offset + num_groups * GROUP_SLOTS * KEY_BYTES
        return cls(num_groups, INDEX_HEADER_BYTES, slots_offset, -(-size // 4096) * 4096)

    @classmethod
    def from_header(cls, header: bytes | memoryview) -> SegmentLayout:
        """The layout a segment's header describes.

        Raises:
            ValueError: not an index segment.
        """
        words = memoryview(header)[:INDEX_HEADER_BYTES].cast("Q")
        if words[_MAGIC] != MAGIC or words[_NUM_GROUPS] < 1:
            raise ValueError("not a kvtier key index segment")
        return cls.for_groups(words[_NUM_GROUPS])

    @property
    def num_slots(self) -> int:
        """Keys the table could hold if full."""
        return self.num_groups * GROUP_SLOTS


def rebuild_groups(num_keys: int) -> int:
    """Groups of the table a rebuild holding `num_keys` live keys gets."""
    return max(MIN_GROUPS, math.ceil(num_keys / (GROUP_SLOTS * REBUILD_LOAD)))


def _home_group(key: bytes, num_groups: int) -> int:
    return int.from_bytes(key[:8], "little") % num_groups


class IndexWriter:
    """The one writer of an index segment (not thread-safe: the daemon calls it under its
    store's lock). `buffer` is the segment's writable mapping, `layout.size_bytes` long."""

    def __init__(self, buffer: memoryview, layout: SegmentLayout, generation: int,
                 fingerprint: bytes, alive_ns: int = ALIVE_NS) -> None:
        self.layout = layout
        self._alive_ns = alive_ns
        self.generation = generation
        self._buffer = buffer
        self._header = buffer[:INDEX_HEADER_BYTES].cast("Q")
        self._versions = buffer[layout.versions_offset:layout.slots_offset].cast("Q")
        self._slots_offset = layout.slots_offset
        self._num_groups = layout.num_groups
        full = (1 << GROUP_SLOTS) - 1
        self._free = [full] * layout.num_groups  # per group: bitmask of slots not holding a key
        self._deleted = [0] * layout.num_groups  # per group: bitmask of tombstones
        self._num_deleted = 0
        self._slot_of: dict[bytes, int] = {}
        self._max_used = int(layout.num_slots * MAX_LOAD)
        buffer[_FINGERPRINT_OFFSET:INDEX_HEADER_BYTES] = fingerprint
        header = self._header
        header[_GENERATION] = generation
        header[_NUM_GROUPS] = layout.num_groups
        header[_ALIVE_UNTIL_NS] = time.monotonic_ns() + alive_ns
        header[_MAGIC] = MAGIC  # last: a reader trusts the header once the magic is there

    @property
    def num_keys(self) -> int:
        """Keys published now."""
        return len(self._slot_of)

    def keys(self) -> list[bytes]:
        """The keys published now (for a rebuild)."""
        return list(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def load(self, keys: list[bytes]) -> None:
        """Publish distinct `keys` into this new, unpublished segment (a rebuild), most of them
        in one numpy pass: no reader sees the segment before it is handed out, so no seqlock."""
        assert not self._slot_of, "load() fills a new segment only"
        keys = [key for key in keys if key != EMPTY_KEY and key != DELETED_KEY]
        if not keys:
            return
        queries = np.frombuffer(b"".join(keys), _KEY_DTYPE)
        home = (queries.view(np.uint64)[::2] % np.uint64(self._num_groups)).astype(np.int64)
        order = np.argsort(home, kind="stable")
        sorted_home = home[order]
        # Rank among the keys of the same home group: the first GROUP_SLOTS go straight in.
        rank = np.arange(len(keys)) - np.searchsorted(sorted_home, sorted_home)
        direct = rank < GROUP_SLOTS
        slot_ids = sorted_home[direct] * GROUP_SLOTS + rank[direct]
        placed = order[direct]
        table = np.frombuffer(self._buffer, _KEY_DTYPE, self.layout.num_slots,
                              self._slots_offset)
        table[slot_ids] = queries[placed]
        self._slot_of = dict(zip([keys[i] for i in placed.tolist()], slot_ids.tolist()))
        counts = np.minimum(np.bincount(home, minlength=self._num_groups), GROUP_SLOTS)
        full = (1 << GROUP_SLOTS) - 1
        self._free = [(full >> count) << count for count in counts.tolist()]
        for i in order[~direct].tolist():  # spill into later groups, one at a time
            self.insert(keys[i])

    def needs_rebuild(self) -> bool:
        """Whether keys and tombstones fill more than `MAX_LOAD` of the slots."""
        return len(self._slot_of) + self._num_deleted > self._max_used

    def _write(self, group: int, slot: int, key: bytes) -> None:
        header, versions = self._header, self._versions
        header[_WRITE_SEQ] += 1  # odd: a write is under way
        versions[group] += 1
        offset = self._slots_offset + slot * KEY_BYTES
        self._buffer[offset:offset + KEY_BYTES] = key
        versions[group] += 1
        header[_WRITE_SEQ] += 1

    def insert(self, key: bytes) -> None:
        """Publish `key` (nothing if it is published already). The caller rebuilds once
        `needs_rebuild()`: the table always keeps free slots."""
        if key in self._slot_of or key == EMPTY_KEY or key == DELETED_KEY:
            return
        num_groups, free = self._num_groups, self._free
        group = int.from_bytes(key[:8], "little") % num_groups
        while not free[group]:
            group = (group + 1) % num_groups
        bits = free[group]
        lowest = bits & -bits
        free[group] = bits ^ lowest
        if self._deleted[group] & lowest:
            self._deleted[group] ^= lowest
            self._num_deleted -= 1
        slot = group * GROUP_SLOTS + lowest.bit_length() - 1
        self._write(group, slot, key)
        self._slot_of[key] = slot

    def remove(self, key: bytes) -> None:
        """Unpublish `key` (nothing if it is not published)."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return
        group, bit = divmod(slot, GROUP_SLOTS)
        self._write(group, slot, DELETED_KEY)
        self._free[group] |= 1 << bit
        self._deleted[group] |= 1 << bit
        self._num_deleted += 1

    def beat(self) -> None:
        """Tell readers the daemon is alive for `alive_ns` more."""
        self._header[_ALIVE_UNTIL_NS] = time.monotonic_ns() + self._alive_ns

    def retire(self) -> None:
        """Mark the segment superseded: readers ask for the new one."""
        self._header[_RETIRED] = 1


class IndexReader:
    """Lookups in a mapped index segment; `buffer` may be read-only. Any number of threads."""

    def __init__(self, buffer: memoryview | bytes, layout: SegmentLayout) -> None:
        self.layout = layout
        view = memoryview(buffer)
        self._header = view[:INDEX_HEADER_BYTES].cast("Q")
        array = np.frombuffer(view, np.uint8, layout.size_bytes)
        self._versions = array[layout.versions_offset:layout.slots_offset].view(np.uint64)
        self._slots = array[layout.slots_offset:layout.slots_offset
                            + layout.num_slots * KEY_BYTES].view(_KEY_DTYPE).reshape(
                                layout.num_groups, GROUP_SLOTS)
        self._num_groups = np.uint64(layout.num_groups)

    @property
    def generation(self) -> int:
        """The segment's generation (a new one per rebuild, per daemon start)."""
        return int(self._header[_GENERATION])

    @property
    def fingerprint(self) -> bytes:
        """The fingerprint of the namespace whose keys the segment holds."""
        return bytes(self._header.cast("B")[_FINGERPRINT_OFFSET:INDEX_HEADER_BYTES])

    @property
    def retired(self) -> bool:
        """Whether the daemon replaced this segment (or stopped)."""
        return bool(self._header[_RETIRED])

    def longest_prefix(self, keys: Sequence[bytes]) -> int | None:
        """How many leading `keys` are published; None when the segment is retired, its daemon
        stopped beating, or writes tore every try (ask the daemon instead).

        Raises:
            ValueError: the keys are not 16 bytes each (as a whole: a 15-byte key beside a
                17-byte one is not caught here; the daemon refuses them at recall).
        """
        if not keys:
            return 0
        raw = b"".join(keys)
        if len(raw) != KEY_BYTES * len(keys):  # the total only: a per-key check costs a loop
            raise ValueError(f"keys must be {KEY_BYTES} bytes each")
        queries = np.frombuffer(raw, _KEY_DTYPE)
        home = queries.view(np.uint64)[::2] % self._num_groups
        header = self._header
        if time.monotonic_ns() > header[_ALIVE_UNTIL_NS]:
            return None  # the daemon may be dead: its socket says
        for _ in range(_MAX_READ_TRIES):
            if header[_RETIRED]:
                return None
            seq = header[_WRITE_SEQ]
            if not seq & 1:
                # Fast path: no write under way; any write meanwhile moves write_seq.
                found = (self._slots[home] == queries[:, None]).view(np.uint64).ravel()
                if header[_WRITE_SEQ] == seq:
                    if found.all():
                        return len(keys)
                    first = int(found.argmin())
                    if (self._slots[home[first]] == _EMPTY).any():
                        answer: int | None = first  # it is not in its home group, nor beyond
                    else:
                        answer = self._resolve(queries, home, found != 0, checked=False)
                    if answer is not None and header[_WRITE_SEQ] == seq:
                        return answer
                    continue
            answer = self._resolve(queries, home, np.zeros(len(keys), bool), checked=True)
            if answer is not None:
                return answer
        return None

    def _resolve(self, queries: np.ndarray, home: np.ndarray, found: np.ndarray,
                 checked: bool) -> int | None:
        """The prefix, probing past full groups for the keys not `found` yet; with `checked`,
        each group is trusted only if its version was even and unchanged around the read
        (None: one was not)."""
        slots, versions, num_groups = self._slots, self._versions, self._num_groups
        pending = np.flatnonzero(~found)
        probe = home[pending]
        for _ in range(self.layout.num_groups):
            if not pending.size:
                break
            before = versions[probe] if checked else None
            groups = slots[probe]
            if before is not None:
                after = versions[probe]
                if ((before != after) | ((before & 1) != 0)).any():
                    return None  # a group changed while read: try the whole lookup again
            hit = (groups == queries[pending, None]).view(np.uint64).ravel() != 0
            found[pending[hit]] = True
            # No empty slot in the group (8 bools read as one word): the key may lie beyond.
            spill = ((groups == _EMPTY).view(np.uint64).ravel() == 0) & ~hit
            pending, probe = pending[spill], (probe[spill] + 1) % num_groups
        return len(found) if found.all() else int(np.argmin(found))
