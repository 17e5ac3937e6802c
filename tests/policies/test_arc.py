"""ARC stories: each asserts the exact order in which keys leave, and how the target p moves."""

from __future__ import annotations

import pytest

from kvtier.policies import ArcPolicy, Key
from kvtier.testing.policies import drain, reference


def test_keys_seen_once_leave_in_insertion_order() -> None:
    arc = ArcPolicy(3)
    for k in "abc":
        reference(arc, k)
    assert reference(arc, "d") == ["a"]
    assert drain(arc) == ["b", "c", "d"]


def test_a_hit_moves_the_key_to_t2_which_outlasts_t1() -> None:
    arc = ArcPolicy(3)
    for k in "abc":
        reference(arc, k)
    reference(arc, "a")
    # p is 0, so T1 (b, c, then d) empties before T2 (a) is touched.
    assert reference(arc, "d") == ["b"]
    assert drain(arc) == ["c", "d", "a"]


def test_a_b1_ghost_hit_grows_p_and_returns_the_key_to_t2() -> None:
    arc = ArcPolicy(3)
    reference(arc, "a")
    reference(arc, "b")
    reference(arc, "a")  # T2 = [a]
    reference(arc, "c")  # T1 = [b, c]
    assert reference(arc, "d") == ["b"]  # b becomes a B1 ghost
    assert arc.target_t1_pages == 0
    # b comes back: T1 was too small, so p grows by 1 and T1 gives up c to make room.
    assert reference(arc, "b") == ["c"]
    assert arc.target_t1_pages == 1
    assert "b" in arc
    # T1 = [d] now sits at p, so REPLACE takes T2's oldest: a, then b (in T2, not T1), then d.
    assert drain(arc) == ["a", "b", "d"]


def test_a_b2_ghost_hit_shrinks_p_and_breaks_the_tie_toward_t1() -> None:
    arc = ArcPolicy(4)
    for k in "abab":
        reference(arc, k)  # T2 = [a, b]
    for k in "cd":
        reference(arc, k)  # T1 = [c, d]
    assert reference(arc, "e") == ["c"]
    assert reference(arc, "f") == ["d"]  # B1 = [c, d]
    assert reference(arc, "c") == ["e"]
    assert reference(arc, "d") == ["a"]  # p = 2, T1 = [f] is below it: T2 gives up a to B2
    assert arc.target_t1_pages == 2
    # a's return shrinks p to 1 == |T1|; a B2 hit breaks that tie by taking T1's f, not T2's b.
    assert reference(arc, "a") == ["f"]
    assert arc.target_t1_pages == 1
    assert drain(arc) == ["b", "c", "d", "a"]


def test_pinned_keys_are_skipped_and_keep_their_place() -> None:
    arc = ArcPolicy(3)
    for k in "abc":
        reference(arc, k)
    assert arc.choose_victim(lambda k: k != "a") == "b"
    assert "a" in arc
    assert drain(arc) == ["a", "c"]


def test_a_fully_pinned_t1_falls_back_to_t2() -> None:
    arc = ArcPolicy(3)
    for k in "abcc":
        reference(arc, k)  # T1 = [a, b], T2 = [c]
    assert arc.choose_victim(lambda k: k == "c") == "c"
    assert len(arc) == 2 and "a" in arc and "b" in arc


def test_no_victim_when_every_key_is_pinned() -> None:
    arc = ArcPolicy(3)
    for k in "abcc":
        reference(arc, k)
    assert arc.choose_victim(lambda k: False) is None
    assert len(arc) == 3


def test_remove_leaves_no_ghost_and_unknown_keys_are_ignored() -> None:
    arc = ArcPolicy(2)
    for k in "aba":
        reference(arc, k)  # T2 = [a], T1 = [b]
    arc.on_remove("b")
    arc.on_remove("zz")
    arc.on_access("zz")
    assert "b" not in arc and len(arc) == 1
    # Had b left a ghost it would come back into T2 and a would go first.
    reference(arc, "b")
    assert drain(arc) == ["b", "a"]


def test_reinserting_a_resident_key_counts_as_a_hit() -> None:
    arc = ArcPolicy(3)
    for k in "abc":
        arc.on_insert(k)
    arc.on_insert("a")
    assert len(arc) == 3
    assert drain(arc) == ["b", "c", "a"]


def test_a_scan_does_not_flush_the_hot_key() -> None:
    arc = ArcPolicy(3)
    reference(arc, "hot")
    reference(arc, "hot")
    evicted = [v for i in range(50) for v in reference(arc, f"scan{i}")]
    assert "hot" not in evicted
    assert "hot" in arc
    assert evicted == [f"scan{i}" for i in range(48)]


def assert_directory_bounds(arc: ArcPolicy) -> None:
    c = arc.capacity_pages
    assert len(arc._t1) + len(arc._b1) <= c
    assert len(arc) + len(arc._b1) + len(arc._b2) <= 2 * c
    assert 0 <= arc.target_t1_pages <= c
    lists = (arc._t1, arc._t2, arc._b1, arc._b2)
    assert sum(map(len, lists)) == len(set().union(*lists))


class ArcModel:
    """ARC as the paper and the policy's docs state it, on plain lists from least recent (front)
    to most recent (back): a B1 ghost's return grows p by max(1, |B2|/|B1|), a B2 ghost's
    shrinks it by max(1, |B1|/|B2|); REPLACE takes T1's oldest while |T1| > p (or == p when the
    key coming in is a B2 ghost), else T2's, and the victim becomes a ghost of its list; the
    directory keeps |T1| + |B1| <= c and everything within 2c, B2 giving way first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.t1: list[Key] = []
        self.t2: list[Key] = []
        self.b1: list[Key] = []
        self.b2: list[Key] = []
        self.p = 0.0
        self.incoming: Key | None = None

    def miss(self, key: Key) -> None:
        self.incoming = key
        if key in self.b1:
            self.p = min(self.capacity, self.p + max(1.0, len(self.b2) / len(self.b1)))
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))

    def evict(self) -> Key:
        num_t1 = len(self.t1)
        if num_t1 and (num_t1 > self.p or (self.incoming in self.b2 and num_t1 == self.p)):
            victim = self.t1.pop(0)
            self.b1.append(victim)
        elif self.t2:
            victim = self.t2.pop(0)
            self.b2.append(victim)
        else:
            victim = self.t1.pop(0)
            self.b1.append(victim)
        return victim

    def insert(self, key: Key) -> None:
        self.incoming = None
        if key in self.b1 or key in self.b2:
            (self.b1 if key in self.b1 else self.b2).remove(key)
            self.t2.append(key)
        else:
            self.t1.append(key)
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.pop(0)
        while (self.b1 or self.b2) and sum(
                map(len, (self.t1, self.t2, self.b1, self.b2))) > 2 * self.capacity:
            (self.b2 or self.b1).pop(0)

    def hit(self, key: Key) -> None:
        (self.t1 if key in self.t1 else self.t2).remove(key)
        self.t2.append(key)

    def remove(self, key: Key) -> None:
        for keys in (self.t1, self.t2, self.b1, self.b2):
            if key in keys:
                keys.remove(key)
        if self.incoming == key:
            self.incoming = None


@pytest.mark.parametrize("capacity", [1, 2, 7, 32])
def test_random_workload_evicts_as_the_paper_says(capacity: int, drive_against_model) -> None:
    arc = ArcPolicy(capacity)
    model = ArcModel(capacity)

    def check(policy: ArcPolicy) -> None:
        assert_directory_bounds(policy)
        assert policy.target_t1_pages == model.p

    drive_against_model(arc, model, seed=4321 + capacity, tail_factor=4, check=check)


@pytest.mark.parametrize("capacity", [1, 3, 16])
def test_random_pins_only_block_eviction_when_everything_is_pinned(
        capacity: int, drive_with_random_pins) -> None:
    drive_with_random_pins(ArcPolicy(capacity), seed=99 + capacity, check=assert_directory_bounds)
