"""The lookup plane's shared-memory key index: its layout, its one writer and its readers.

The daemon publishes, per namespace, the keys it holds in a segment that clients map read-only,
so a lookup needs no round trip. The segment is an open-addressing table of 16-byte keys in
groups of `GROUP_SLOTS` slots, an even number of them: a left half and a right half. A key has
a home group in each, picked from its two 8-byte words mixed (below), and goes into whichever
has more free slots, the left one on a tie (d-left hashing, Vöcking, J. ACM 2003:
fuller tables before either overflows); only when both are full does it spill into the
`SPILL_GROUPS` groups after its second, and when those are full too it is not published at all
(refused: counted in `IndexWriter.num_refused`). So a lookup reads a key's two
groups in one gather and is answered there, whatever the table's fill. With one home group and
spills into the next, full groups overflowed in chains that lookups walked: a 256-key lookup in
a 10^5-key table took 43-58 us at 55% fill and 87-103 us at 80%, 16 keys up to 24 us; with two
groups 36-41 us at either fill, 16 keys 5.5-6 (2 cores at load 1-2;
`full_table_lookup_us_p50` of `bench/bench_ipc.py` measures the daemon's own table).

Homes come from the key's two words (w0, w1) mixed: y0 = w0*A + w1*B and y1 = w0*C + w1*D
(mod 2^64, `HOME_MIX`), then each one's high bits pick its group (y // ceil(2^64 / half)).
Words taken as they are (w0 modulo the half, w1 modulo the half) let structured keys pile up:
sequential integers as big-endian keys all have w0 = 0, one left group for every key, so past
a half's slots they spilled into chains that writes and lookups walked (a 65,536-page store
five times slower). Mixed, they spread as random keys do. The matrix is
invertible mod 2^64 (its determinant AD - BC is odd: A, C, D odd, B even), so any two homes
can be hit on purpose: a client that chooses its keys to collide (in a table of any size, when
their mixed words share their high bits) gets its own keys refused past `SPILL_GROUPS`, and no
more work from the writer or the readers than `SPILL_GROUPS` groups a key.

An all-zero slot is empty, an all-0xff slot a deleted key (a tombstone: probes go on past it);
keys equal to either are never published (a lookup of one may count it held: its recall then
finds it missing, as for any page gone since the lookup; hashed keys never take these values).
A key in neither home group is absent when either group has an empty slot (a slot once used is
never empty again, so both were full when the key, if held, spilled), and otherwise when it is
in none of the `SPILL_GROUPS` groups after the second up to the first with an empty slot. A held
key may so read absent (refused a slot): a false miss, which costs its reader a recompute; a key
never reads held unless it is published.

Readers never lock. The writer (one thread: the daemon's, under its store's lock) makes every
slot write odd-then-even on two counters, seqlock style: the group's version and the segment's
`write_seq`. A reader that sees `write_seq` even and unchanged across its whole lookup saw no
write at all (the fast path, no per-group check); otherwise it re-reads each group's version
around the group and trusts only groups it read whole. So a reader never sees a torn key, and a
hit is a key that was published when it was read. Stale answers err only towards a page gone at
recall time: a key is published once its page is READY and unpublished when it leaves its last
tier, and recall goes by key, so it can never yield another page's bytes. Answers of any age
may also err towards a miss (a refused key), never towards a hit. Loads and stores are
taken to be ordered as on x86-64 (TSO): numpy's gathers and the writer's stores run in program
order there.

The daemon also keeps `alive_until_ns` (CLOCK_MONOTONIC, shared by every process of the machine)
a little ahead of now while it runs: a reader past it stops answering, so the index of a daemon
that was killed (and could not retire it) sends its clients back to the socket, which tells them.

When the table fills (live keys and tombstones over `MAX_LOAD` of the slots) the writer's owner
builds a new segment sized for the live keys (`rebuild_groups`), with the next generation, and
then sets the old one's `retired` word: a reader that sees it asks the daemon for the new one.
A large table's owner starts that build at `EARLY_LOAD`, from a copy of the slots, off its lock
(`kvtier.daemon.lookup_plane`).

Lookups, inserts and removes run in C (`kvtier._index_native`, built by setup.py where a
compiler is): 16 keys in 0.9 us, 256 in 6, a page published in 0.5 us; numpy does the same
where it is not built (8 us, 20 us, 2 us), and answers the reads C leaves to it (a write under
way, a key that may have spilled). The writer keeps no map of key to slot: it finds a key in
the table as a reader would, and its own count of live keys and tombstones (a dict of a
million keys held 123 MB of the daemon's heap and made a rebuild under the store's lock
three to four times longer).

Verbs: `SegmentLayout.for_groups` / `from_header`, `IndexWriter.insert` / `insert_many` / `remove` /
`remove_many` / `needs_rebuild` / `keys` / `retire` / `num_refused`, `IndexReader.longest_prefix`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

native: ModuleType | None
try:  # the read fast path and the inserts in C (setup.py builds them where a compiler is)
    from kvtier import _index_native as native
except ImportError:
    native = None

# b"VKTIDX03", little-endian (02: homes from the words unmixed, spills unbounded; 01: one home
# group per key). A reader of another format refuses the segment: its client asks the socket.
MAGIC = 0x3330584449544B56
KEY_BYTES = 16
GROUP_SLOTS = 8
INDEX_HEADER_BYTES = 64
EMPTY_KEY = bytes(KEY_BYTES)
DELETED_KEY = b"\xff" * KEY_BYTES
MIN_GROUPS = 16
# A key whose home groups are both full may take a slot in this many groups after its second,
# and in none further: each key then costs a write and a lookup at most this many more groups.
# Random keys never come near it: at `MAX_LOAD`, d-left leaves 1 key in 7,000-30,000 past both
# homes, each in the first group after (2 of 14,554 keys, 5 of 145,460). Keys made to share
# their homes fill those and the spill groups (48 keys at most), and the rest are refused.
SPILL_GROUPS = 4
# (A, B, C, D) of the home mix: the golden-ratio and xxhash multipliers, B made even.
HOME_MIX = (0x9E3779B97F4A7C15, 0x85EBCA77C2B2AE62, 0x165667B19E3779F9, 0xC2B2AE3D27D4EB4F)
_WORD_MASK = (1 << 64) - 1
# Live keys + tombstones over this share of the slots: rebuild. A rebuild sizes the new table so
# the live keys fill `REBUILD_LOAD` of it: 17 bytes a slot (key + an eighth of its group's
# version) are 21.3-30.9 bytes a held page across the fill cycle (<= 32).
MAX_LOAD = 0.8
REBUILD_LOAD = 0.55
# Over this share, a large index's owner starts building its successor off the store's lock
# (`kvtier.daemon.lookup_plane`), and lets the table fill to `STRETCHED_LOAD` meanwhile rather
# than wait for it: a 256-key lookup took 18-19 us at 85 % (15-16 at 80 %), 131 at 90 %, where
# enough keys spill past their homes that C leaves most lookups to numpy.
EARLY_LOAD = 0.7
STRETCHED_LOAD = 0.85
_ITEM_MATCH_KEYS = 32  # lookups of up to this many keys compare 16-byte items, longer ones words
_MAX_READ_TRIES = 3  # a lookup torn by writes this many times is answered by the socket
# The daemon beats every BEAT_S; a reader trusts the index for ALIVE_NS past the last beat. A
# daemon too busy to beat in time costs its clients a round trip, never a wrong answer.
BEAT_S = 0.01
ALIVE_NS = 100_000_000

# Header words (uint64).
_MAGIC, _GENERATION, _RETIRED, _WRITE_SEQ, _NUM_GROUPS, _ALIVE_UNTIL_NS = range(6)
_FINGERPRINT_OFFSET = 48  # 16 bytes: the namespace's fingerprint
_KEY_DTYPE = np.dtype("V16")
# words @ _MIX_MATRIX: (w0, w1) -> (w0*A + w1*B, w0*C + w1*D), wrapping as uint64 does.
_MIX_MATRIX = np.array([[HOME_MIX[0], HOME_MIX[2]], [HOME_MIX[1], HOME_MIX[3]]], np.uint64)
_EMPTY = np.frombuffer(EMPTY_KEY, _KEY_DTYPE)
_DELETED = np.frombuffer(DELETED_KEY, _KEY_DTYPE)
_BATCH_KEYS = 24  # `insert_many` places this many new keys or more in numpy, fewer one by one
_POPCOUNT = np.array([mask.bit_count() for mask in range(1 << GROUP_SLOTS)], np.intp)
# _NTH_BIT[mask, r]: the r-th lowest set bit of a group's mask; -1 past its last (and in the
# extra last column, where ranks beyond a group are clipped to).
_NTH_BIT = np.full((1 << GROUP_SLOTS, GROUP_SLOTS + 1), -1, np.intp)
for _mask in range(1 << GROUP_SLOTS):
    _set = [bit for bit in range(GROUP_SLOTS) if _mask >> bit & 1]
    _NTH_BIT[_mask, :len(_set)] = _set


@dataclass(slots=True, frozen=True)
class SegmentLayout:
    """Where the parts of an index segment of `num_groups` groups lie."""

    num_groups: int
    versions_offset: int
    slots_offset: int
    size_bytes: int

    @classmethod
    def for_groups(cls, num_groups: int) -> SegmentLayout:
        """The layout of a segment of `num_groups` groups (even, >= 4).

        Raises:
            ValueError: `num_groups` is odd or under 4 (a key's two groups must differ, and a
                half's divisor, 2^64 / half rounded up, must fit a word).
        """
        if num_groups < 4 or num_groups % 2:
            raise ValueError(f"an index has an even number of groups, not {num_groups}")
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
    groups = max(MIN_GROUPS, math.ceil(num_keys / (GROUP_SLOTS * REBUILD_LOAD)))
    return groups + groups % 2


def half_divisor(num_groups: int) -> int:
    """What a mixed word is divided by for its group in a half of `num_groups` groups: its high
    bits pick the group (the low bits of a product depend on the low bits of the word only)."""
    return -(-(1 << 64) // (num_groups // 2))


def home_groups(key: bytes, num_groups: int) -> tuple[int, int]:
    """The groups `key` may live in, one in each half of an even `num_groups` (then up to
    `SPILL_GROUPS` groups after the second, when both are full)."""
    return _home_groups(key, num_groups // 2, half_divisor(num_groups))


def _home_groups(key: bytes, half: int, divisor: int) -> tuple[int, int]:
    first, second = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    a, b, c, d = HOME_MIX
    return (((first * a + second * b) & _WORD_MASK) // divisor,
            half + ((first * c + second * d) & _WORD_MASK) // divisor)


def joined(keys: Sequence[bytes]) -> bytes:
    """`keys` joined, for C and numpy; ValueError unless they are 16 bytes each (as a whole)."""
    raw = b"".join(keys)
    if len(raw) != KEY_BYTES * len(keys):
        raise ValueError(f"keys must be {KEY_BYTES} bytes each")
    return raw


def _split(raw: bytes) -> list[bytes]:
    """The keys joined in `raw`."""
    return [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


def _homes(words: np.ndarray, divisor: np.uint64, right_half: np.ndarray) -> np.ndarray:
    """`home_groups` of each key of `words` (keys, 2 uint64 words): a (keys, 2) intp array;
    `right_half` is [0, half]. One numpy call more than the words' residues were (~1 us)."""
    return ((words @ _MIX_MATRIX) // divisor).view(np.intp) + right_half


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
        # numpy views of the same words, for the writes of a batch
        self._version_words = np.frombuffer(buffer, np.uint64, layout.num_groups,
                                            layout.versions_offset)
        self._table = np.frombuffer(buffer, _KEY_DTYPE, layout.num_slots, layout.slots_offset)
        # Per group, a byte each: the bitmask of slots not holding a key, and of tombstones;
        # indexed one at a time as bytes, a batch at a time through the numpy views.
        self._free = bytearray(b"\xff" * layout.num_groups)
        self._deleted = bytearray(layout.num_groups)
        self._free_bits = np.frombuffer(self._free, np.uint8)
        self._deleted_bits = np.frombuffer(self._deleted, np.uint8)
        self._right_half = np.array([0, layout.num_groups // 2])
        self._half = layout.num_groups // 2
        self._divisor = half_divisor(layout.num_groups)
        self._divisor_word = np.uint64(self._divisor)
        self._num_deleted = 0
        self.num_refused = 0  # keys not published: their homes and `SPILL_GROUPS` after, full
        # The table is the only record of where keys are (`_find`): a dict of key -> slot cost
        # more than the placement and 100 bytes of heap a key.
        self._num_keys = 0
        self._slots_2d = self._table.reshape(layout.num_groups, GROUP_SLOTS)
        self._native_layout = (layout.versions_offset, layout.slots_offset, layout.num_groups)
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
        return self._num_keys

    def keys(self) -> list[bytes]:
        """The keys published now, in slot order: the slots whose free bit is clear."""
        taken = np.unpackbits(~self._free_bits, bitorder="little").view(bool)
        return _split(self._table[taken].tobytes())

    def __contains__(self, key: bytes) -> bool:
        return self._find([key])[0] >= 0

    def _find(self, keys: Sequence[bytes]) -> list[int]:
        """The slot of each of `keys`, -1 where it is not published: its home groups and the
        `SPILL_GROUPS` after the second (a key spilled while both homes were full stays there
        when they free up; C reads those only when neither home has an empty slot, numpy
        always). The writer's own reads: no seqlock."""
        if not keys:
            return []
        raw = joined(keys)
        if native is not None:
            found: list[int] = native.find(self._buffer, raw, *self._native_layout)
            return found
        queries = np.frombuffer(raw, _KEY_DTYPE)
        homes = _homes(queries.view(np.uint64).reshape(-1, 2), self._divisor_word,
                       self._right_half)
        probed = np.concatenate(
            [homes, (homes[:, 1:] + np.arange(1, SPILL_GROUPS + 1)) % self._num_groups], axis=1)
        matches = (self._slots_2d[probed] == queries[:, None, None]).reshape(len(keys), -1)
        reserved = (queries == _EMPTY) | (queries == _DELETED)
        group, position = np.divmod(matches.argmax(axis=1), GROUP_SLOTS)
        slots = probed[np.arange(len(keys)), group] * GROUP_SLOTS + position
        return np.where(matches.any(axis=1) & ~reserved, slots, -1).tolist()

    def slots_copy(self, into: np.ndarray | None = None) -> np.ndarray:
        """Every slot's bytes, copied (into `into`, `slots_bytes` of uint8, when given): a
        rebuild's snapshot of the keys (`load_joined` passes over the empty slots and
        tombstones). A memcpy: the store's lock is held for it (into new memory, its page faults
        cost five times the copy)."""
        if into is None or into.nbytes != self._table.nbytes:
            return self._table.view(np.uint8).copy()
        np.copyto(into, self._table.view(np.uint8))
        return into

    @property
    def slots_bytes(self) -> int:
        """The bytes of the table's slots (what `slots_copy` copies)."""
        return self._table.nbytes

    def load(self, keys: list[bytes]) -> None:
        """Publish distinct `keys` into this new, unpublished segment (a rebuild), most of them
        in one numpy pass: no reader sees the segment before it is handed out, so no seqlock."""
        if EMPTY_KEY in keys or DELETED_KEY in keys:  # a scan in C: the filter is rarely due
            keys = [key for key in keys if key != EMPTY_KEY and key != DELETED_KEY]
        self.load_joined(joined(keys))

    def load_joined(self, raw: bytes | np.ndarray) -> None:
        """`load` of distinct keys joined in `raw` (or another segment's `slots_copy`: its
        empty slots and tombstones are passed over). In C a large load leaves the GIL to other
        threads."""
        assert not self._num_keys, "load() fills a new segment only"
        if not len(raw):
            return
        if native is not None:  # distinct, and none published: no key need be looked for
            self._insert_native_joined(raw, skip_published=False)
            return
        queries = np.frombuffer(raw, _KEY_DTYPE)
        queries = queries[(queries != _EMPTY) & (queries != _DELETED)]
        num_keys = len(queries)
        homes = _homes(queries.view(np.uint64).reshape(-1, 2), self._divisor_word,
                       self._right_half)
        used = np.zeros(self._num_groups, np.int64)  # slots taken per group, from slot 0 up
        slot_ids = np.full(num_keys, -1, np.int64)
        # Rounds of placement by rank among the keys that want the same group: half a group
        # in first homes, then second homes, then first homes again, to the brim. Balanced
        # like `insert`'s choice, so few keys end up past both their homes; those go, as in
        # `insert`, to the first of the `SPILL_GROUPS` groups after the second with room (a
        # key left over from a round found that group full), or are refused.
        rounds = [(0, 0, GROUP_SLOTS // 2), (1, 0, GROUP_SLOTS), (0, 0, GROUP_SLOTS)]
        rounds += [(1, step, GROUP_SLOTS) for step in range(1, SPILL_GROUPS + 1)]
        for which, step, cap in rounds:
            waiting = np.flatnonzero(slot_ids < 0)
            if not waiting.size:
                break
            wanted = homes[waiting, which]
            if step:
                wanted = (wanted + step) % self._num_groups
            order = np.argsort(wanted, kind="stable")
            sorted_wanted = wanted[order]
            rank = np.arange(len(order)) - np.searchsorted(sorted_wanted, sorted_wanted)
            position = used[sorted_wanted] + rank
            fits = position < cap
            slot_ids[waiting[order[fits]]] = sorted_wanted[fits] * GROUP_SLOTS + position[fits]
            used += np.bincount(sorted_wanted[fits], minlength=self._num_groups)
        placed = np.flatnonzero(slot_ids >= 0)
        self.num_refused += num_keys - len(placed)
        self._table[slot_ids[placed]] = queries[placed]
        self._num_keys = len(placed)
        self._free_bits[:] = (((1 << GROUP_SLOTS) - 1) >> used) << used  # slot 0 up taken

    def needs_rebuild(self) -> bool:
        """Whether keys and tombstones fill more than `MAX_LOAD` of the slots."""
        return self._num_keys + self._num_deleted > self._max_used

    def fill(self) -> float:
        """The share of the slots keys and tombstones fill."""
        return (self._num_keys + self._num_deleted) / self.layout.num_slots

    def stretch(self) -> None:
        """Let keys and tombstones fill `STRETCHED_LOAD` of the slots before `needs_rebuild`
        (while the successor builds)."""
        self._max_used = int(self.layout.num_slots * STRETCHED_LOAD)

    def _write(self, group: int, slot: int, key: bytes) -> None:
        header, versions = self._header, self._versions
        header[_WRITE_SEQ] += 1  # odd: a write is under way
        versions[group] += 1
        offset = self._slots_offset + slot * KEY_BYTES
        self._buffer[offset:offset + KEY_BYTES] = key
        versions[group] += 1
        header[_WRITE_SEQ] += 1

    def insert(self, key: bytes) -> None:
        """Publish `key` (nothing if it is published already; nor if its home groups and the
        `SPILL_GROUPS` after the second are full: it is refused, counted in `num_refused`, and
        reads absent). The caller rebuilds once `needs_rebuild()`."""
        if key == EMPTY_KEY or key == DELETED_KEY or self._find([key])[0] >= 0:
            return
        num_groups, free = self._num_groups, self._free
        first, second = _home_groups(key, self._half, self._divisor)
        if free[first] or free[second]:
            group = first if free[first].bit_count() >= free[second].bit_count() else second
        else:  # both full: the first of the next `SPILL_GROUPS` groups with a free slot
            for step in range(1, SPILL_GROUPS + 1):
                group = (second + step) % num_groups
                if free[group]:
                    break
            else:
                self.num_refused += 1
                return
        bits = free[group]
        # The lowest free slot: slots are taken from slot 0 up, so a group's used slots are a
        # prefix of it and its tombstones come before its empty slots (reused first).
        lowest = bits & -bits
        free[group] = bits ^ lowest
        if self._deleted[group] & lowest:
            self._deleted[group] ^= lowest
            self._num_deleted -= 1
        slot = group * GROUP_SLOTS + lowest.bit_length() - 1
        self._write(group, slot, key)
        self._num_keys += 1

    def room(self) -> int:
        """Keys `insert_many` may take before the table needs a rebuild (at least one)."""
        return max(1, self._max_used - self._num_keys - self._num_deleted)

    def insert_many(self, keys: Sequence[bytes]) -> None:
        """Publish `keys` (at most `room()` of them new) as `insert` would; many at once in one
        write: each key's group and slot chosen in numpy, the slots filled in one assignment
        inside one seqlock window. A key whose chosen group the batch filled is placed by
        `insert` afterwards."""
        if native is not None:  # C passes over reserved patterns and keys published already
            if keys:
                self._insert_native(keys, skip_published=True)
            return
        fresh = dict.fromkeys(keys)  # distinct, in order
        fresh.pop(EMPTY_KEY, None)  # the reserved patterns are never published
        fresh.pop(DELETED_KEY, None)
        new = [key for key, slot in zip(fresh, self._find(list(fresh))) if slot < 0]
        if len(new) < _BATCH_KEYS:
            for key in new:
                self.insert(key)
            return
        queries = np.frombuffer(b"".join(new), _KEY_DTYPE)
        homes = _homes(queries.view(np.uint64).reshape(-1, 2), self._divisor_word,
                       self._right_half)
        free_bits, deleted_bits = self._free_bits, self._deleted_bits
        free_count = _POPCOUNT[free_bits[homes]]
        wanted = np.where(free_count[:, 1] > free_count[:, 0], homes[:, 1], homes[:, 0])
        # Keys wanting the same group take its free slots lowest first, as `insert` does: rank
        # r gets the r-th, or none when the group has fewer.
        order = np.argsort(wanted, kind="stable")
        groups = wanted[order]
        rank = np.arange(len(new)) - np.searchsorted(groups, groups)
        position = _NTH_BIT[free_bits[groups], np.minimum(rank, GROUP_SLOTS)]
        fits = position >= 0
        placed, groups, position = order[fits], groups[fits], position[fits]
        if placed.size:
            first_of_group = np.empty(len(groups), bool)
            first_of_group[0] = True
            np.not_equal(groups[1:], groups[:-1], out=first_of_group[1:])
            starts = np.flatnonzero(first_of_group)
            touched = groups[starts]
            taken = np.bitwise_or.reduceat((1 << position).astype(np.uint8), starts)
            self._num_deleted -= int(_POPCOUNT[deleted_bits[touched] & taken].sum())
            deleted_bits[touched] &= ~taken
            free_bits[touched] &= ~taken
            slots = groups * GROUP_SLOTS + position
            self._num_keys += len(slots)
            self._write_many(slots, queries[placed])
        for i in order[~fits].tolist():
            self.insert(new[i])

    def _insert_native(self, keys: Sequence[bytes], skip_published: bool) -> None:
        """Publish `keys` in C (see `_insert_native_joined`)."""
        self._insert_native_joined(joined(keys), skip_published)

    def _insert_native_joined(self, raw: bytes | np.ndarray, skip_published: bool) -> None:
        """Publish the keys joined in `raw` in C, passing over reserved patterns and, with
        `skip_published`, keys published already (without, the caller knows none are)."""
        assert native is not None
        num_placed, num_refused, num_undeleted = native.insert(
            self._buffer, self._free, self._deleted, raw, *self._native_layout, skip_published)
        self._num_keys += num_placed
        self._num_deleted -= num_undeleted
        self.num_refused += num_refused  # past both full homes and the spill groups

    def insert_joined(self, raw: bytes) -> None:
        """`insert_many` of the keys joined in `raw` (in C, a large batch leaves the GIL)."""
        if native is not None:
            self._insert_native_joined(raw, skip_published=True)
        else:
            self.insert_many(_split(raw))

    def remove_joined(self, raw: bytes) -> None:
        """`remove_many` of the keys joined in `raw` (in C, a large batch leaves the GIL)."""
        if native is not None:
            self._remove_native_joined(raw)
        else:
            self.remove_many(_split(raw))

    def remove_many(self, keys: Sequence[bytes]) -> None:
        """Unpublish `keys` as `remove` would, in one write."""
        if native is not None:
            self._remove_native_joined(joined(keys))
            return
        # A key named twice is unpublished once.
        slots = sorted({slot for slot in self._find(keys) if slot >= 0})
        if len(slots) < 2:
            for slot in slots:
                self._unpublish_slot(slot)
            return
        where = np.array(slots)
        groups, bits = np.divmod(where, GROUP_SLOTS)
        masks = (1 << bits).astype(np.uint8)
        np.bitwise_or.at(self._free_bits, groups, masks)
        np.bitwise_or.at(self._deleted_bits, groups, masks)
        self._num_deleted += len(slots)
        self._num_keys -= len(slots)
        self._write_many(where, _DELETED)

    def _remove_native_joined(self, raw: bytes) -> None:
        assert native is not None
        num_removed = native.remove(self._buffer, self._free, self._deleted, raw,
                                    *self._native_layout)
        self._num_deleted += num_removed
        self._num_keys -= num_removed

    def _write_many(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Write `values` (16-byte void, or one to write in every slot) into `slots`, with
        each group touched odd around the writes, as `_write` does for one."""
        header = self._header
        # A group named twice is still bumped once: `+=` through an index array reads every
        # element before writing any.
        groups = slots // GROUP_SLOTS
        header[_WRITE_SEQ] += 1  # odd: a write is under way
        self._version_words[groups] += 1
        self._fill(slots, values)
        self._version_words[groups] += 1
        header[_WRITE_SEQ] += 1

    def _fill(self, slots: np.ndarray, values: np.ndarray) -> None:
        self._table[slots] = values

    def remove(self, key: bytes) -> None:
        """Unpublish `key` (nothing if it is not published)."""
        slot = self._find([key])[0]
        if slot >= 0:
            self._unpublish_slot(slot)

    def _unpublish_slot(self, slot: int) -> None:
        group, bit = divmod(slot, GROUP_SLOTS)
        self._write(group, slot, DELETED_KEY)
        self._free[group] |= 1 << bit
        self._deleted[group] |= 1 << bit
        self._num_deleted += 1
        self._num_keys -= 1

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
        self._num_groups = layout.num_groups
        # The same slots as each key's two little-endian words (see `_match`); a key's home
        # groups are rows `homes` of either, the right half's offset by `_right_half`.
        self._group_words = self._slots.view(np.uint64).reshape(layout.num_groups,
                                                                 GROUP_SLOTS, 2)
        self._divisor = np.uint64(half_divisor(layout.num_groups))
        self._right_half = np.array([0, layout.num_groups // 2])
        # `native.longest_prefix`'s arguments after the keys
        self._segment = view
        self._native_layout = (layout.slots_offset, layout.num_groups)

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
        header = self._header
        if native is not None:
            if header[_RETIRED] or time.monotonic_ns() > header[_ALIVE_UNTIL_NS]:
                return None
            answer: int = native.longest_prefix(self._segment, raw, *self._native_layout)
            if answer >= 0:
                return answer
            # a write tore the read, or the first missing key may have spilled: numpy answers
        return self._numpy_prefix(raw, len(keys))

    def _numpy_prefix(self, raw: bytes, num_keys: int) -> int | None:
        """`longest_prefix` of the `num_keys` keys joined in `raw`, in numpy."""
        queries = np.frombuffer(raw, _KEY_DTYPE)
        words = queries.view(np.uint64).reshape(-1, 2)  # (key, word)
        homes = _homes(words, self._divisor, self._right_half)  # (key, home)
        header = self._header
        if time.monotonic_ns() > header[_ALIVE_UNTIL_NS]:
            return None  # the daemon may be dead: its socket says
        for _ in range(_MAX_READ_TRIES):
            if header[_RETIRED]:
                return None
            seq = header[_WRITE_SEQ]
            if not seq & 1:
                # Fast path: no write under way; any write meanwhile moves write_seq. Both home
                # groups of every key in one take (`_match`). A key is in one slot at most and
                # its two groups differ, so n matches are n keys found.
                groups, matches = self._match(queries, words, homes)
                if header[_WRITE_SEQ] == seq:
                    if np.count_nonzero(matches) == num_keys:
                        return num_keys
                    found: np.ndarray = np.asarray(matches.any(axis=1))
                    first = int(found.argmin())
                    if (groups[first] == _EMPTY).any():
                        answer: int | None = first  # in neither home, and it did not spill
                    else:
                        answer = self._resolve(queries, homes, found, checked=False)
                    if answer is not None and header[_WRITE_SEQ] == seq:
                        return answer
                    continue
            answer = self._resolve(queries, homes, np.zeros(num_keys, bool), checked=True)
            if answer is not None:
                return answer
        return None

    def _match(self, queries: np.ndarray, words: np.ndarray,
               homes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Both home groups of each key, read, as 16-byte void (key, slot), and where each
        key matches (key, slot): for many keys as words (a slot matches when both of its
        words do: two true bytes, 0x0101 as a uint16; over 32 keys 30% faster than comparing
        16-byte items), for few as items (fewer numpy calls: 16 keys in 0.7x the time)."""
        num_keys = len(queries)
        if num_keys <= _ITEM_MATCH_KEYS:
            groups = np.take(self._slots, homes, axis=0).reshape(num_keys, -1)
            return groups, groups == queries[:, None]
        taken = np.take(self._group_words, homes, axis=0).reshape(num_keys, -1)
        wanted = np.repeat(words, 2 * GROUP_SLOTS, axis=0).reshape(num_keys, -1)
        matches = (taken == wanted).view(np.uint16) == 0x0101
        return taken.view(_KEY_DTYPE), matches

    def _read_groups(self, probe: np.ndarray, checked: bool) -> np.ndarray | None:
        """Groups `probe`, read; with `checked`, None unless each group's version was even and
        unchanged around the read."""
        if not checked:
            return self._slots[probe]
        before = self._versions[probe]
        groups = self._slots[probe]
        after = self._versions[probe]
        if ((before != after) | ((before & 1) != 0)).any():
            return None  # a group changed while read: try the whole lookup again
        return groups

    def _resolve(self, queries: np.ndarray, homes: np.ndarray, found: np.ndarray,
                 checked: bool) -> int | None:
        """The prefix, reading the home groups of the keys not `found` yet, then up to
        `SPILL_GROUPS` groups past the second for those whose home groups are both full; with
        `checked`, each group is trusted only if its version was even and unchanged around the
        read (None: one was not)."""
        num_groups = self._num_groups
        pending = np.flatnonzero(~found)
        both_full = np.ones(len(pending), bool)
        for which in (0, 1):
            groups = self._read_groups(homes[pending, which], checked)
            if groups is None:
                return None
            found[pending] |= (groups == queries[pending, None]).view(np.uint64).ravel() != 0
            both_full &= (groups == _EMPTY).view(np.uint64).ravel() == 0
        pending = pending[both_full & ~found[pending]]
        probe = (homes[pending, 1] + 1) % num_groups
        for _ in range(SPILL_GROUPS):
            if not pending.size:
                break
            groups = self._read_groups(probe, checked)
            if groups is None:
                return None
            hit = (groups == queries[pending, None]).view(np.uint64).ravel() != 0
            found[pending[hit]] = True
            # No empty slot in the group: the key may lie beyond.
            spill = ((groups == _EMPTY).view(np.uint64).ravel() == 0) & ~hit
            pending, probe = pending[spill], (probe[spill] + 1) % num_groups
        return len(found) if found.all() else int(np.argmin(found))
