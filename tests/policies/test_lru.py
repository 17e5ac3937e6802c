"""LRU stories: each asserts the exact order in which keys leave."""

from __future__ import annotations


import pytest

from kvtier.policies import Key, LruPolicy


def reference(policy: LruPolicy, key: Key) -> list[Key]:
    """Look `key` up the way PageStore does; return the keys evicted to make room for it."""
    if key in policy:
        policy.on_access(key)
        return []
    policy.on_miss(key)
    assert policy.admit(key)
    evicted: list[Key] = []
    while len(policy) >= policy.capacity_pages:
        victim = policy.choose_victim(lambda k: True)
        assert victim is not None
        evicted.append(victim)
    policy.on_insert(key)
    return evicted


def drain(policy: LruPolicy) -> list[Key]:
    """Evict everything, returning the order."""
    order: list[Key] = []
    while (victim := policy.choose_victim(lambda k: True)) is not None:
        order.append(victim)
    return order


def test_keys_leave_in_insertion_order_when_untouched() -> None:
    lru = LruPolicy(3)
    assert [reference(lru, k) for k in "abc"] == [[], [], []]
    assert reference(lru, "d") == ["a"]
    assert drain(lru) == ["b", "c", "d"]
    assert len(lru) == 0


def test_a_hit_sends_the_key_to_the_back() -> None:
    lru = LruPolicy(3)
    for k in "abc":
        reference(lru, k)
    reference(lru, "a")
    assert reference(lru, "d") == ["b"]
    assert drain(lru) == ["c", "a", "d"]


def test_reinserting_a_resident_key_counts_as_a_hit() -> None:
    lru = LruPolicy(3)
    for k in "abc":
        lru.on_insert(k)
    lru.on_insert("a")
    assert len(lru) == 3
    assert drain(lru) == ["b", "c", "a"]


def test_pinned_keys_are_skipped_and_keep_their_place() -> None:
    lru = LruPolicy(3)
    for k in "abc":
        reference(lru, k)
    assert lru.choose_victim(lambda k: k != "a") == "b"
    assert "a" in lru
    # a was only skipped, not used: it is still the oldest.
    assert drain(lru) == ["a", "c"]


def test_no_victim_when_every_key_is_pinned() -> None:
    lru = LruPolicy(2)
    for k in "ab":
        reference(lru, k)
    assert lru.choose_victim(lambda k: False) is None
    assert len(lru) == 2 and "a" in lru and "b" in lru


def test_remove_forgets_the_key_and_unknown_keys_are_ignored() -> None:
    lru = LruPolicy(3)
    for k in "abc":
        reference(lru, k)
    lru.on_remove("b")
    lru.on_remove("zz")
    lru.on_access("zz")
    assert "b" not in lru and "zz" not in lru
    assert len(lru) == 2
    assert drain(lru) == ["a", "c"]


def test_a_scan_flushes_the_hot_key() -> None:
    lru = LruPolicy(3)
    reference(lru, "hot")
    for _ in range(5):
        reference(lru, "hot")
    evicted = [v for i in range(10) for v in reference(lru, f"scan{i}")]
    assert evicted[0] == "hot"
    assert "hot" not in lru


@pytest.mark.parametrize("capacity", [1, 2, 7, 32])
def test_random_workload_matches_a_simulated_cache(capacity: int, drive_against_model) -> None:
    drive_against_model(LruPolicy(capacity), seed=1234 + capacity, tail_factor=10)