"""The lookup plane's key index on its own: answers against a plain set of the keys written, and a
reader racing a writer that is slow on purpose never takes a half-written key for a key."""

from __future__ import annotations

import mmap
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

from kvtier import key_index
from kvtier.key_index import (
    DELETED_KEY,
    EMPTY_KEY,
    GROUP_SLOTS,
    HOME_MIX,
    SPILL_GROUPS,
    IndexReader,
    IndexWriter,
    SegmentLayout,
    half_divisor,
    home_groups,
    rebuild_groups,
)

FINGERPRINT = b"n" * 16


@pytest.fixture(autouse=True, params=["native", "numpy"])
def reader_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test reads through both: the C fast path (numpy behind it for what it leaves),
    and numpy alone, as where no compiler built the C part."""
    if request.param == "numpy":
        monkeypatch.setattr(key_index, "native", None)
    elif key_index.native is None:
        pytest.skip("kvtier._index_native is not built (see tests/test_packaging.py)")
    return str(request.param)


def new_index(num_groups: int) -> tuple[IndexWriter, IndexReader]:
    layout = SegmentLayout.for_groups(num_groups)
    buffer = memoryview(bytearray(layout.size_bytes))
    # No daemon beats here: the writer vouches for itself for a day.
    writer = IndexWriter(buffer, layout, 1, FINGERPRINT, alive_ns=86_400 * 10**9)
    return writer, IndexReader(buffer.toreadonly(), layout)


def homed_key(number: int, first: int, second: int, num_groups: int) -> bytes:
    """A distinct key (by `number`) whose home groups are `first` (in the left half of the
    `num_groups`) and `second` (in the right): mixed words chosen in those groups' ranges,
    unmixed with the inverse of the home mix (mod 2^64)."""
    half = num_groups // 2
    assert first < half <= second < num_groups
    divisor = half_divisor(num_groups)
    offset = number + 1  # within any group's range of mixed words (those are >= divisor - half)
    assert offset < divisor - half
    mixed = (first * divisor + offset, (second - half) * divisor + offset)
    a, b, c, d = HOME_MIX
    inverse_det = pow(a * d - b * c, -1, 1 << 64)
    words = ((d * mixed[0] - b * mixed[1]) * inverse_det % (1 << 64),
             (a * mixed[1] - c * mixed[0]) * inverse_det % (1 << 64))
    key = words[0].to_bytes(8, "little") + words[1].to_bytes(8, "little")
    assert home_groups(key, num_groups) == (first, second)
    return key


def expected_prefix(keys: list[bytes], held: set[bytes]) -> int:
    return next((i for i, key in enumerate(keys) if key not in held), len(keys))


def test_prefixes_match_the_keys_written_through_inserts_removes_and_full_groups() -> None:
    rng = np.random.default_rng(0)
    writer, reader = new_index(16)
    universe = [rng.bytes(16) for _ in range(160)]
    # Keys that share both home groups spill over into the groups after the second (and past
    # the end of the table, to its start).
    universe += [homed_key(i, 0, 15, 16) for i in range(24)]
    universe += [homed_key(i, 3, 9, 16) for i in range(24, 48)]
    held: set[bytes] = set()
    for step in range(3000):
        key = universe[int(rng.integers(len(universe)))]
        if key in held and rng.random() < 0.5:
            writer.remove(key)
            held.discard(key)
        elif not writer.needs_rebuild():
            writer.insert(key)
            if key in writer:  # else refused: past its `SPILL_GROUPS` (it must read absent)
                held.add(key)
        if step % 10 == 0:
            query = [universe[int(i)] for i in rng.integers(len(universe), size=12)]
            order = sorted(held, key=lambda k: rng.random())[:20]
            assert reader.longest_prefix(query) == expected_prefix(query, held)
            assert reader.longest_prefix(order) == len(order)
            assert reader.longest_prefix(order + [rng.bytes(16)] + order) == len(order)
    assert writer.num_keys == len(held)


def test_a_loaded_segment_answers_as_one_filled_key_by_key() -> None:
    rng = np.random.default_rng(2)
    num_groups = rebuild_groups(624)
    keys = [rng.bytes(16) for _ in range(600)]
    # 16 fill their home groups, 8 go past the second (within `SPILL_GROUPS`, whose groups
    # random keys fill half)
    keys += [homed_key(i, 0, num_groups // 2 + 5, num_groups) for i in range(24)]
    writer, reader = new_index(num_groups)
    writer.load(keys + [EMPTY_KEY])
    assert writer.num_keys == len(keys) and writer.num_refused == 0
    assert all(reader.longest_prefix([key]) == 1 for key in keys)
    assert reader.longest_prefix(keys) == len(keys)
    others = [rng.bytes(16) for _ in range(200)]
    assert all(reader.longest_prefix([key]) == 0 for key in others)
    for key in keys[:300]:  # the writer's bookkeeping holds after a load
        writer.remove(key)
    for key in others:
        writer.insert(key)
    assert reader.longest_prefix(keys[300:] + others) == len(keys) - 300 + len(others)
    assert reader.longest_prefix(keys[:1]) == 0


def test_a_segment_loaded_from_another_ones_slots_holds_its_live_keys_only() -> None:
    """A rebuild's snapshot is every slot, empty ones and tombstones included: the new segment
    holds the live keys and nothing else."""
    rng = np.random.default_rng(7)
    keys = [rng.bytes(16) for _ in range(500)]
    old, _ = new_index(rebuild_groups(500))
    old.insert_many(keys)
    old.remove_many(keys[:150])  # tombstones
    new, reader = new_index(rebuild_groups(old.num_keys))
    new.load_joined(old.slots_copy())
    assert new.num_keys == 350 and new.num_refused == 0
    assert sorted(new.keys()) == sorted(keys[150:])
    assert reader.longest_prefix(keys[150:]) == 350
    assert EMPTY_KEY not in new and DELETED_KEY not in new


def test_the_empty_and_deleted_patterns_are_never_published() -> None:
    writer, reader = new_index(16)
    writer.insert(EMPTY_KEY)
    writer.insert(DELETED_KEY)
    assert writer.num_keys == 0
    assert EMPTY_KEY not in writer and DELETED_KEY not in writer


def test_an_index_whose_writer_stopped_beating_answers_nothing() -> None:
    layout = SegmentLayout.for_groups(16)
    buffer = memoryview(bytearray(layout.size_bytes))
    writer = IndexWriter(buffer, layout, 1, FINGERPRINT, alive_ns=0)
    reader = IndexReader(buffer.toreadonly(), layout)
    writer.insert(b"k" * 16)
    assert reader.longest_prefix([b"k" * 16]) is None  # its deadline passed at once
    writer._alive_ns = 86_400 * 10**9
    writer.beat()
    assert reader.longest_prefix([b"k" * 16]) == 1


def test_a_retired_index_answers_nothing_and_keys_are_checked() -> None:
    writer, reader = new_index(16)
    writer.insert(b"k" * 16)
    assert reader.longest_prefix([b"k" * 16]) == 1
    with pytest.raises(ValueError):
        reader.longest_prefix([b"short"])
    writer.retire()
    assert reader.retired and reader.longest_prefix([b"k" * 16]) is None


def test_keys_past_both_full_home_groups_are_found_and_absent_ones_are_not() -> None:
    """Twenty keys homed on groups 2 and 10: sixteen fill those, four go past group 10. A key
    of the same homes not written must not be found (it is probed for past group 10, up to a
    group with an empty slot), and removing keys of the home groups leaves the spilled ones
    found."""
    writer, reader = new_index(16)
    keys = [homed_key(i, 2, 10, 16) for i in range(20)]
    for key in keys:
        writer.insert(key)
    absent = homed_key(99, 2, 10, 16)
    assert reader.longest_prefix(keys) == 20
    assert reader.longest_prefix(keys[16:]) == 4
    assert reader.longest_prefix(keys[:3] + [absent] + keys) == 3
    for key in keys[:10]:
        writer.remove(key)
    assert reader.longest_prefix(keys[10:]) == 10
    assert reader.longest_prefix(keys[:10]) == 0
    writer.insert(absent)  # into a tombstone of a home group
    assert reader.longest_prefix([absent] + keys[16:]) == 5


@pytest.mark.parametrize("byteorder", ["big", "little"])
def test_sequential_integer_keys_spread_as_random_ones_do(
        byteorder: Literal["big", "little"]) -> None:
    """Sequential integers as keys (as an engine that numbers its pages might send) leave few
    keys past their home groups, by a load and by inserts: unmixed, big-endian ones all shared
    one left group and few right ones, and most spilled."""
    keys = [i.to_bytes(16, byteorder) for i in range(1, 10_001)]  # not 0: the empty pattern
    num_groups = rebuild_groups(len(keys))
    loaded, _ = new_index(num_groups)
    loaded.load(keys)
    inserted, reader = new_index(num_groups)
    for key in keys:
        inserted.insert(key)
    for writer in (loaded, inserted):
        assert writer.num_keys == len(keys) and writer.num_refused == 0
        past_homes = sum(slot // GROUP_SLOTS not in home_groups(key, num_groups)
                         for key, slot in zip(keys, writer._find(keys)))
        assert past_homes <= len(keys) // 1000, past_homes
    assert reader.longest_prefix(keys) == len(keys)


@pytest.mark.parametrize("batched", [False, True])
def test_a_key_that_spilled_is_found_and_unpublished_after_its_homes_free_up(
        batched: bool) -> None:
    """The table is the writer's only record of where a key is: a key that spilled past two
    full homes stays in its spill group when a home frees a slot (a tombstone), and must still
    be found there: unpublished by a remove, not published twice by an insert."""
    num_groups = 32
    homes = [homed_key(i, 3, 20, num_groups) for i in range(2 * GROUP_SLOTS)]
    spilled = homed_key(99, 3, 20, num_groups)
    writer, reader = new_index(num_groups)

    def publish(keys: list[bytes]) -> None:
        if batched:
            writer.insert_many(keys)
        for key in [] if batched else keys:
            writer.insert(key)

    def unpublish(keys: list[bytes]) -> None:
        if batched:
            writer.remove_many(keys)
        for key in [] if batched else keys:
            writer.remove(key)

    publish(homes + [spilled])
    assert writer._find([spilled])[0] // GROUP_SLOTS == 21  # the first group past the second
    unpublish(homes[:1])
    assert spilled in writer and homes[0] not in writer
    publish([spilled])  # held already
    assert writer.num_keys == 2 * GROUP_SLOTS and writer._num_deleted == 1
    unpublish([spilled, spilled])
    assert spilled not in writer and reader.longest_prefix([spilled]) == 0
    assert writer.num_keys == 2 * GROUP_SLOTS - 1 and writer._num_deleted == 2
    assert sorted(writer.keys()) == sorted(homes[1:])


def test_keys_made_to_collide_cost_bounded_work_and_are_refused_past_the_spill() -> None:
    """Keys a client built to share both home groups take those and the `SPILL_GROUPS` after
    the second; the rest are refused (counted, and read absent), for no more work a key than
    random keys cost (unbounded, each walked the chain the ones before it made: 10x)."""
    num_groups = 1024
    colliding = [homed_key(i, 5, 700, num_groups) for i in range(5000)]
    rng = np.random.default_rng(11)
    randoms = [rng.bytes(16) for _ in range(5000)]

    def fill_s(keys: list[bytes], by_load: bool) -> float:
        writer, _ = new_index(num_groups)
        start = time.perf_counter()
        if by_load:
            writer.load(keys)
        else:
            for key in keys:
                writer.insert(key)
        return time.perf_counter() - start

    for by_load in (False, True):  # alternately, the best of three each: a busy machine
        colliding_s, random_s = [], []
        for _ in range(3):
            colliding_s.append(fill_s(colliding, by_load))
            random_s.append(fill_s(randoms, by_load))
        assert min(colliding_s) < 3 * min(random_s), (by_load, colliding_s, random_s)

    writer, reader = new_index(num_groups)
    writer.insert_many(colliding[:2000])
    for key in colliding[2000:] + randoms:
        writer.insert(key)
    published = [key for key in colliding if key in writer]
    assert len(published) == (2 + SPILL_GROUPS) * GROUP_SLOTS
    held = [key for key in randoms if key in writer]  # less those that drew the full groups
    assert writer.num_refused == len(colliding) + len(randoms) - writer.num_keys
    assert reader.longest_prefix(published + held) == len(published) + len(held)
    refused = [key for key in colliding + randoms if key not in writer]
    assert all(reader.longest_prefix([key]) == 0 for key in refused[::10])
    assert reader.longest_prefix(published[:5] + [homed_key(10**6, 5, 700, num_groups)]) == 5


def test_a_segment_of_the_format_before_is_refused() -> None:
    """A reader of this format finds other homes than a writer of VKTIDX02 chose: it refuses
    such a segment (its client then asks the socket) rather than miss every key."""
    writer, _ = new_index(16)
    header = bytearray(writer._buffer[:64])
    assert SegmentLayout.from_header(bytes(header)).num_groups == 16
    header[:8] = b"VKTIDX02"
    with pytest.raises(ValueError):
        SegmentLayout.from_header(bytes(header))


def test_a_rebuild_sizes_the_table_within_32_bytes_a_page() -> None:
    for num_keys in (1000, 20_000, 300_000):
        layout = SegmentLayout.for_groups(rebuild_groups(num_keys))
        most = int(layout.num_slots * 0.8)  # where the next rebuild comes
        used_bytes = layout.slots_offset + layout.num_slots * 16  # less the rounding to 4 KiB
        assert used_bytes / num_keys <= 32
        assert used_bytes / most <= 22
        assert layout.num_slots % GROUP_SLOTS == 0


@pytest.fixture
def fast_switching() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads trade the GIL between the writer's steps
    yield
    sys.setswitchinterval(interval)


def test_a_reader_never_sees_a_torn_key(fast_switching: None) -> None:
    """The writer writes each key in two halves, letting readers run in between (as a writer in
    another process may be seen half-way through its copy). Keys share both home groups, so slots
    go key -> tombstone -> another key; the half-written patterns are probed for and must miss,
    and the keys always published must always hit."""
    writer, reader = new_index(16)
    churned = [homed_key(i, 0, 8, 16) for i in range(6)]
    kept = [homed_key(i, 0, 8, 16) for i in range(6, 10)]

    def write_in_halves(group: int, slot: int, key: bytes) -> None:
        header, versions = writer._header, writer._versions
        header[3] += 1
        versions[group] += 1
        offset = writer._slots_offset + slot * 16
        writer._buffer[offset:offset + 8] = key[:8]
        for _ in range(20):  # a window between the halves, with the GIL given up
            pass
        writer._buffer[offset + 8:offset + 16] = key[8:]
        versions[group] += 1
        header[3] += 1

    writer._write = write_in_halves  # type: ignore[method-assign]
    for key in kept:
        writer.insert(key)

    def churn_one_by_one() -> None:
        for key in churned:
            writer.insert(key)
        for key in churned:
            writer.remove(key)

    assert_no_torn_key_is_read(reader, churned, kept, churn_one_by_one)


def assert_no_torn_key_is_read(reader: IndexReader, churned: list[bytes], kept: list[bytes],
                               churn: Callable[[], None]) -> None:
    """While another thread repeats `churn` (which writes `churned` keys in and out), probe
    every half-written pattern of those keys and of `kept` (published throughout): none may
    read as published, in a lookup of one key or one long enough to compare words, and `kept`
    must always read whole (or the reader gives up: None)."""
    torn = [key[:8] + DELETED_KEY[8:] for key in churned + kept]
    torn += [DELETED_KEY[:8] + key[8:] for key in churned + kept]
    mixed = churned[:6]  # halves of two keys: 30 pairs of the first six keep the probe short
    torn += [a[:8] + b[8:] for a in mixed for b in mixed if a != b]
    many_kept = kept * 9
    stop = threading.Event()

    def churn_until_stopped() -> None:
        while not stop.is_set():
            churn()

    thread = threading.Thread(target=churn_until_stopped)
    thread.start()
    try:
        seen_torn = []
        for _ in range(600):
            for key in torn:
                if reader.longest_prefix([key]) == 1:
                    seen_torn.append(key)
                if reader.longest_prefix([key] + many_kept):  # a lookup long enough for words
                    seen_torn.append(key)
            answer = reader.longest_prefix(kept)
            assert answer in (len(kept), None), answer  # None: writes tore every try
    finally:
        stop.set()
        thread.join()
    assert not seen_torn, f"{len(seen_torn)} torn keys read as published"


@pytest.mark.parametrize(("num_groups", "most_keys"), [(16, 12), (16, 80), (64, 200)])
def test_batched_inserts_and_removes_answer_as_single_ones(num_groups: int,
                                                           most_keys: int) -> None:
    """Batches with repeats, held keys and keys whose home groups are both full, each within
    the writer's room, leave the table answering as a plain set of the keys (small batches go
    key by key, large ones through numpy, where keys compete for their groups' slots)."""
    rng = np.random.default_rng(7)
    writer, reader = new_index(num_groups)
    universe = [rng.bytes(16) for _ in range(num_groups * 10)]
    universe += [homed_key(i, 2, num_groups - 3, num_groups) for i in range(24)]  # spill
    held: set[bytes] = set()
    for step in range(600):
        batch = [universe[int(i)] for i in rng.integers(len(universe), size=int(rng.integers(
            1, most_keys)))]
        if rng.random() < 0.4:
            writer.remove_many(batch + batch[:2])
            held.difference_update(batch)
        elif not writer.needs_rebuild():
            batch = batch[:writer.room()]
            writer.insert_many(batch + batch[:1])
            held.update(key for key in batch if key in writer)  # less the refused
        query = [universe[int(i)] for i in rng.integers(len(universe), size=12)]
        assert reader.longest_prefix(query) == expected_prefix(query, held), step
        order = sorted(held, key=lambda k: rng.random())[:20]
        assert reader.longest_prefix(order) == len(order)
    assert writer.num_keys == len(held)
    assert sorted(writer.keys()) == sorted(held)
    tombstones = writer._table == np.frombuffer(DELETED_KEY, writer._table.dtype)
    assert writer._num_deleted == np.count_nonzero(tombstones)  # what a rebuild is timed by


def test_a_reader_never_sees_a_torn_key_of_a_batch(fast_switching: None) -> None:
    """As above, for the batched writes: each batch's slots are filled in two halves with the
    GIL given up between them, and no half-filled key is ever read as published."""
    writer, reader = new_index(16)
    churned = [homed_key(i, 0, 8, 16) for i in range(10, 34)]  # a batch placed in numpy
    kept = [homed_key(i, 0, 8, 16) for i in range(6, 10)]
    table = writer._table.view(np.uint8).reshape(-1, 16)

    def fill_in_halves(slots: np.ndarray, values: np.ndarray) -> None:
        halves = np.ascontiguousarray(np.broadcast_to(values, slots.shape)).view(
            np.uint8).reshape(-1, 16)
        table[slots, :8] = halves[:, :8]
        for _ in range(20):  # a window between the halves, with the GIL given up
            pass
        table[slots, 8:] = halves[:, 8:]

    writer._fill = fill_in_halves  # type: ignore[method-assign]
    writer.insert_many(kept)

    def churn_in_batches() -> None:
        writer.insert_many(churned)
        writer.remove_many(churned)

    assert_no_torn_key_is_read(reader, churned, kept, churn_in_batches)


# A writer in another process (the daemon's, in service): it writes keys A and B in turn into
# one slot, each in two halves, write_seq and the group's version odd around them, with a window
# in between: half-way from B to A the slot holds A's first half and B's second.
_HALF_WRITER = r"""
import mmap, sys
path, slot_offset, group_offset, count = sys.argv[1], *map(int, sys.argv[2:5])
a, b = bytes.fromhex(sys.argv[5]), bytes.fromhex(sys.argv[6])
with open(path, "r+b") as file:
    segment = mmap.mmap(file.fileno(), 0)
words = memoryview(segment).cast("Q")
for value in [a, b] * count:
    words[3] += 1
    words[group_offset // 8] += 1
    segment[slot_offset:slot_offset + 8] = value[:8]
    for _ in range(200):
        pass
    segment[slot_offset + 8:slot_offset + 16] = value[8:]
    words[group_offset // 8] += 1
    words[3] += 1
"""


def test_a_reader_never_sees_a_key_torn_by_a_writer_in_another_process(tmp_path: Path) -> None:
    """Key X is never written, but a slot of its home group holds X half-way through each
    write of A (X's first half, then another) over B (another, then X's second half), made by
    another process, as the daemon's writes are: X must never read as published, and keys
    published throughout must always read whole. (In one process the threads' tests above
    tear a write only between the writer's bytecodes.)"""
    layout = SegmentLayout.for_groups(16)
    path = tmp_path / "index"
    path.write_bytes(bytes(layout.size_bytes))
    with open(path, "r+b") as file:
        segment = mmap.mmap(file.fileno(), 0)
    view = memoryview(segment)
    writer = IndexWriter(view, layout, 1, FINGERPRINT, alive_ns=86_400 * 10**9)
    reader = IndexReader(view.toreadonly(), layout)
    kept = [homed_key(i, 0, 8, 16) for i in range(4)]
    torn, placeholder = homed_key(98, 0, 8, 16), homed_key(99, 0, 8, 16)
    for key in kept + [placeholder]:
        writer.insert(key)
    slot = writer._find([placeholder])[0]
    assert slot // GROUP_SLOTS == 0  # a slot of X's first home group, for the child to write
    a, b = torn[:8] + b"a" * 8, b"b" * 8 + torn[8:]
    child = subprocess.Popen([sys.executable, "-c", _HALF_WRITER, str(path),
                              str(layout.slots_offset + slot * 16),
                              str(layout.versions_offset + slot // GROUP_SLOTS * 8),
                              "20000", a.hex(), b.hex()])
    seen_torn = answers = 0
    try:
        while child.poll() is None:
            seen_torn += reader.longest_prefix([torn]) == 1
            answer = reader.longest_prefix(kept)
            assert answer in (len(kept), None), answer  # None: writes tore every try
            answers += 1
    finally:
        child.kill()
        child.wait()
        del view, writer, reader
        segment.close()
    assert child.returncode == 0
    assert answers and not seen_torn, f"X read as published {seen_torn} times in {answers}"


def test_the_c_inserts_place_every_key_where_one_by_one_inserts_do(reader_path: str) -> None:
    """`insert_many` and `remove_many` in C are `insert` and `remove` key by key: the same
    slots, tombstones reused the same way, keys refused alike, slot bytes alike, through
    removes and keys made to collide."""
    if reader_path == "numpy":
        pytest.skip("compares the C inserts with the Python ones")
    rng = np.random.default_rng(3)
    batched, batched_reader = new_index(32)
    single, _ = new_index(32)
    colliding = [homed_key(i, 3, 20, 32) for i in range(60)]
    universe = [rng.bytes(16) for _ in range(150)] + colliding
    for round_number in range(40):
        batch = [universe[i] for i in rng.integers(0, len(universe), 24)]
        batched.insert_many(batch)
        for key in batch:
            single.insert(key)
        gone = [universe[i] for i in rng.integers(0, len(universe), 12 + round_number % 5)]
        batched.remove_many(gone)
        for key in gone:
            single.remove(key)
        slots = slice(batched.layout.slots_offset, None)  # counters differ: one batch, one
        assert bytes(batched._buffer[slots]) == bytes(single._buffer[slots])  # write_seq window
        assert (batched._free, batched._deleted) == (single._free, single._deleted)
        assert batched.keys() == single.keys() and batched.num_keys == single.num_keys
        assert (batched.num_refused, batched._num_deleted) == (single.num_refused,
                                                                single._num_deleted)
    assert batched.num_refused  # the colliding keys overflowed their groups and spills
    held = set(batched.keys())
    assert batched_reader.longest_prefix(list(held)) == len(held)
