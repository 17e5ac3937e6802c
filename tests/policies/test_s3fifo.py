"""S3-FIFO stories: each asserts the exact order in which keys leave.

Capacity 10 gives a small queue S of 1 page, a main queue M of 9 and a ghost queue of 9 keys.
"""

from __future__ import annotations

import pytest

from kvtier.policies import Key, S3FifoPolicy
from kvtier.testing.policies import drain, reference


def test_queue_sizes_follow_capacity() -> None:
    assert S3FifoPolicy(10).small_capacity_pages == 1
    assert S3FifoPolicy(10).ghost_capacity_keys == 9
    assert S3FifoPolicy(3).small_capacity_pages == 1
    assert S3FifoPolicy(100).small_capacity_pages == 10


def test_one_hit_wonders_leave_s_in_fifo_order() -> None:
    s3 = S3FifoPolicy(10)
    for k in "abcdefghij":
        reference(s3, k)
    assert reference(s3, "k") == ["a"]
    assert drain(s3) == list("bcdefghijk")


def test_a_key_hit_while_in_s_is_promoted_to_m() -> None:
    s3 = S3FifoPolicy(10)
    for k in "abcdefghij":
        reference(s3, k)
    reference(s3, "a")
    # a is at S's head but was hit, so it moves to M and b, the next one-hit wonder, goes.
    assert reference(s3, "k") == ["b"]
    assert "a" in s3
    assert drain(s3) == list("cdefghijk") + ["a"]


def test_m_gives_a_hit_key_a_second_chance() -> None:
    s3 = S3FifoPolicy(10)
    for k in "abcdefghij":
        reference(s3, k)
    reference(s3, "a")
    reference(s3, "b")
    assert reference(s3, "k") == ["c"]  # a and b moved to M with their counters reset
    reference(s3, "a")
    # Once S is empty, M's head a is hit, so it is requeued behind b, which goes first.
    assert drain(s3) == list("defghijk") + ["b", "a"]


def test_a_ghost_hit_reenters_m() -> None:
    s3 = S3FifoPolicy(10)
    for k in "abcdefghij":
        reference(s3, k)
    assert reference(s3, "k") == ["a"]
    assert "a" not in s3
    # G remembers a, so its quick return skips S and outlives every key still in S.
    assert reference(s3, "a") == ["b"]
    assert drain(s3) == list("cdefghijk") + ["a"]


def test_reinserting_a_resident_key_counts_as_a_hit() -> None:
    s3 = S3FifoPolicy(3)
    for k in "abc":
        s3.on_insert(k)
    s3.on_insert("a")
    assert len(s3) == 3
    assert drain(s3) == ["b", "c", "a"]


def test_pinned_keys_go_to_the_tail_of_their_queue() -> None:
    s3 = S3FifoPolicy(3)
    for k in "abc":
        reference(s3, k)
    assert s3.choose_victim(lambda k: k != "a") == "b"
    assert "a" in s3
    assert drain(s3) == ["c", "a"]


def test_a_fully_pinned_s_falls_back_to_m() -> None:
    s3 = S3FifoPolicy(10)
    for k in "abcdefghij":
        reference(s3, k)
    reference(s3, "a")
    assert reference(s3, "k") == ["b"]  # S = [c..k], M = [a]
    assert s3.choose_victim(lambda k: k == "a") == "a"
    assert len(s3) == 9


def test_no_victim_when_every_key_is_pinned_even_with_hit_counters() -> None:
    s3 = S3FifoPolicy(3)
    for k in "abc":
        reference(s3, k)
    reference(s3, "a")
    assert s3.choose_victim(lambda k: True) == "b"  # a moved to M on the way
    for _ in range(5):
        reference(s3, "a")  # counter saturates at 3
    reference(s3, "c")
    assert s3.choose_victim(lambda k: False) is None
    assert len(s3) == 2 and "a" in s3 and "c" in s3
    # The fruitless pass promoted c behind a, then spent a's second chances requeueing it
    # behind c: looking is not free in S3-FIFO, even when nothing can leave.
    assert drain(s3) == ["c", "a"]


def test_remove_leaves_no_ghost_and_unknown_keys_are_ignored() -> None:
    s3 = S3FifoPolicy(10)
    reference(s3, "a")
    s3.on_remove("a")
    s3.on_remove("zz")
    s3.on_access("zz")
    assert "a" not in s3 and len(s3) == 0
    # Had a left a ghost it would come back into M and leave last.
    for k in "bac":
        reference(s3, k)
    assert drain(s3) == ["b", "a", "c"]


def test_a_scan_does_not_flush_the_hot_key() -> None:
    s3 = S3FifoPolicy(3)
    reference(s3, "hot")
    reference(s3, "hot")
    evicted = [v for i in range(50) for v in reference(s3, f"scan{i}")]
    assert "hot" not in evicted
    assert "hot" in s3
    assert evicted == [f"scan{i}" for i in range(48)]


class S3FifoModel:
    """S3-FIFO as the policy's docs state it, on plain lists from head (front) to tail: S holds
    a tenth of the capacity (at least 1), G the rest. Evict from S while it is at its size or M
    is empty, else from M; S's head moves to M if it was hit (counter reset), else leaves and is
    remembered in G; M's head is requeued with one hit less while it has any, else leaves. A
    key G remembers enters M; counters saturate at 3."""

    def __init__(self, capacity: int) -> None:
        self.small_pages = max(1, capacity // 10)
        self.ghost_keys = capacity - self.small_pages
        self.small: list[Key] = []
        self.main: list[Key] = []
        self.ghost: list[Key] = []
        self.hits: dict[Key, int] = {}

    def miss(self, key: Key) -> None:
        pass

    def hit(self, key: Key) -> None:
        self.hits[key] = min(3, self.hits[key] + 1)

    def insert(self, key: Key) -> None:
        if key in self.ghost:
            self.ghost.remove(key)
            self.main.append(key)
        else:
            self.small.append(key)
        self.hits[key] = 0

    def remove(self, key: Key) -> None:
        for keys in (self.small, self.main, self.ghost):
            if key in keys:
                keys.remove(key)
        del self.hits[key]

    def evict(self) -> Key:
        while True:
            if self.small and (len(self.small) >= self.small_pages or not self.main):
                key = self.small.pop(0)
                if self.hits[key]:
                    self.hits[key] = 0
                    self.main.append(key)
                    continue
                self.ghost.append(key)
                if len(self.ghost) > self.ghost_keys:
                    self.ghost.pop(0)
            else:
                key = self.main.pop(0)
                if self.hits[key]:
                    self.hits[key] -= 1
                    self.main.append(key)
                    continue
            del self.hits[key]
            return key


@pytest.mark.parametrize("capacity", [1, 2, 7, 32])
def test_random_workload_evicts_as_the_docs_say(capacity: int, drive_against_model) -> None:
    drive_against_model(S3FifoPolicy(capacity), S3FifoModel(capacity), seed=777 + capacity,
                        tail_factor=4)


@pytest.mark.parametrize("capacity", [1, 3, 16])
def test_random_pins_only_block_eviction_when_everything_is_pinned(
        capacity: int, drive_with_random_pins) -> None:
    drive_with_random_pins(S3FifoPolicy(capacity), seed=55 + capacity)
