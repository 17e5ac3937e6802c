"""Prefix-aware policy stories: leaves leave before parents, reused prefixes outlive one-offs."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvtier.policies import LruPolicy, PrefixPolicy
from kvtier.policies.base import Key
from kvtier.testing.policies import drain, request


def test_a_request_leaves_tail_first() -> None:
    policy = PrefixPolicy(8)
    request(policy, ["a1", "a2", "a3"], set())
    assert drain(policy) == ["a3", "a2", "a1"]


def test_older_requests_go_before_newer_ones_and_leaves_before_parents() -> None:
    policy = PrefixPolicy(4)
    resident: set[Key] = set()
    request(policy, ["a1", "a2"], resident)
    request(policy, ["b1", "b2"], resident)
    assert request(policy, ["c1"], resident) == ["a2"]
    assert request(policy, ["c2"], resident) == ["a1"]
    assert drain(policy) == ["b2", "b1", "c1", "c2"]


def test_a_shared_root_stays_while_any_child_is_resident() -> None:
    policy = PrefixPolicy(4)
    resident: set[Key] = set()
    request(policy, ["root", "a"], resident)
    request(policy, ["root", "b"], resident)
    request(policy, ["root", "c"], resident)
    # Full: the next request evicts the oldest leaf, never the root its children need.
    assert request(policy, ["root", "d"], resident) == ["a"]
    assert drain(policy) == ["b", "c", "d", "root"]


def test_a_hot_root_outlives_one_off_pages_once_the_history_shows_it_returns() -> None:
    policy = PrefixPolicy(3)
    resident: set[Key] = set()
    # The history learns that "sys" comes back after three other pages; one-off pages never do.
    # The first round knows nothing yet and evicts by recency alone. The second has seen one
    # page come back once, no page used twice yet: "sys" (now used twice) is rated like the
    # one-off pages, and recency decides again. From the third on, "sys" stays.
    kept = []
    for round_ in range(6):
        request(policy, ["sys"], resident)
        for i in range(3):
            request(policy, [f"once{round_}-{i}"], resident)
        kept.append("sys" in policy)
    assert kept == [False, False] + [True] * 4
    # With nothing learned, recency alone decides: the same pages push the root out.
    fresh = PrefixPolicy(3)
    for key in ["sys", "once0", "once1", "once2"]:
        request(fresh, [key], set())
    assert "sys" not in fresh


def test_pages_whose_returns_come_late_are_kept_until_they_come_back() -> None:
    # Every new page comes back exactly once, ten rounds (twenty references) later: farther
    # than a tier of four pages can see by recency, so LRU never hits. Once the history has
    # seen it, the policy lets fresh pages and pages already back go, and keeps pages that
    # have waited: some are there when they return.
    def run(make: Callable[[], object]) -> int:
        policy = make()
        resident: set[Key] = set()
        hits = 0
        for round_ in range(300):
            request(policy, [f"new{round_}"], resident)
            returning = f"new{round_ - 10}"
            hits += round_ >= 200 and returning in policy
            request(policy, [returning], resident)
        return hits

    assert run(lambda: LruPolicy(4)) == 0
    assert run(lambda: PrefixPolicy(4)) >= 20  # of 100 returns; at most 4 / 10 can be held


def test_pinned_leaves_are_skipped_and_parents_of_pinned_leaves_stay() -> None:
    policy = PrefixPolicy(8)
    request(policy, ["a1", "a2"], set())
    request(policy, ["b1"], set())
    assert policy.choose_victim(lambda k: k != "a2") == "b1"
    assert policy.choose_victim(lambda k: k != "a2") is None  # a1 has a resident child
    assert drain(policy) == ["a2", "a1"]


def test_a_parent_inserted_after_its_child_is_not_a_leaf() -> None:
    # On disk the host demotes leaves first, so children arrive before their parents.
    policy = PrefixPolicy(8)
    policy.on_insert("c", "b")
    policy.on_insert("b", "a")
    policy.on_insert("a", None)
    assert drain(policy) == ["c", "b", "a"]


def test_a_child_of_an_evicted_page_is_refused_and_so_are_its_children() -> None:
    policy = PrefixPolicy(2)
    resident: set[Key] = set()
    request(policy, ["a1"], resident)
    request(policy, ["b1", "b2"], resident)
    assert resident == {"b1", "b2"}  # a1 left: the oldest leaf
    assert not policy.admit("a2", "a1")
    assert not policy.admit("a3", "a2")  # a2 was refused: its child is useless too
    assert policy.admit("c1", None)



def test_a_run_admitted_in_one_call_is_refused_from_its_first_page_under_a_gone_parent(
) -> None:
    policy = PrefixPolicy(2)
    resident: set[Key] = set()
    request(policy, ["a1"], resident)
    request(policy, ["b1", "b2"], resident)
    policy.on_access("b1")  # a hit before the store, as a request makes
    assert policy.admit_many([("c1", None), ("a2", "a1"), ("a3", "a2"), ("b3", "b2")]) == [
        True, False, False, True]
    assert policy.admit_many([("a2", "a1")]) == [False]  # a new run: still known to be gone


def test_the_parent_of_a_page_being_stored_is_not_evicted() -> None:
    policy = PrefixPolicy(3)
    resident: set[Key] = set()
    request(policy, ["a1", "a2"], resident)
    request(policy, ["b1"], resident)
    # As the store does: admit the whole run first, then make room, then insert.
    assert policy.admit("a3", "a2") and policy.admit("a4", "a3")
    assert policy.choose_victim(lambda k: True) == "b1"  # a2 is older, but a3 needs it
    assert policy.choose_victim(lambda k: True) is None  # a1 and a2 hold the run's prefix
    policy.on_insert("a3", "a2")  # a4 finds no room: its store fails
    assert policy.choose_victim(lambda k: True) is None  # until the next store begins
    assert not policy.admit("a5", "a4")  # a4 was abandoned: known to be absent
    assert drain(policy) == ["a3", "a2", "a1"]


def test_a_chain_longer_than_the_tier_keeps_its_head() -> None:
    policy = PrefixPolicy(3)
    resident: set[Key] = set()
    request(policy, ["x"], resident)
    request(policy, ["a1", "a2", "a3", "a4", "a5"], resident)
    assert resident == {"a1", "a2", "a3"}
    assert drain(policy) == ["a3", "a2", "a1"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", [4, 16, 64])
def test_random_requests_keep_every_resident_parent_resident(seed: int, capacity: int) -> None:
    rng = random.Random(seed)
    policy = PrefixPolicy(capacity)
    resident: set[Key] = set()
    parent_of: dict[Key, Key | None] = {}
    conversations = [[f"c{c}-0"] for c in range(12)]
    for _ in range(600):
        chain = rng.choice(conversations)
        # Chains may outgrow the tier: their tails cannot all be resident.
        if rng.random() < 0.5 and len(chain) < capacity + 4:
            chain.append(f"{chain[0]}-{len(chain)}")
        for index, key in enumerate(chain):
            parent_of[key] = chain[index - 1] if index else None
        pinned = set(rng.sample(sorted(resident), min(len(resident), 2)))
        request(policy, list(chain), resident, lambda k: k not in pinned)
        assert len(policy) == len(resident) <= capacity
        assert all(k in policy for k in resident)
        # Prefix consistency: no resident page has lost its parent.
        assert all(parent_of[k] is None or parent_of[k] in resident for k in resident)
    # No leaf is lost from the eviction order: every resident page can still be evicted.
    assert sorted(drain(policy)) == sorted(resident)


@pytest.mark.parametrize("capacity", [64, 1 << 16])
def test_stale_leaf_filings_stay_bounded_over_a_long_run(capacity: int) -> None:
    # Every page is filed as a leaf, then goes stale when its child arrives or it is touched
    # again: a heap cannot remove from the middle, so the policy must drop them itself.
    rng = random.Random(7)
    policy = PrefixPolicy(capacity)
    resident: set[Key] = set()
    for number in range(3000):
        chain = [f"root{rng.randrange(4)}"] + [f"r{number}-{i}" for i in range(rng.randint(1, 30))]
        request(policy, chain, resident)
        if number % 10 == 0:
            request(policy, ["hot"], resident)
    filed = sum(len(leaves) for leaves in policy._bucket_to_leaves.values())
    num_leaves = sum(policy._bucket_to_num_leaves.values())
    assert num_leaves <= len(policy)
    assert filed <= 2 * num_leaves + 8 * (len(policy._bucket_to_leaves) + 64)
    assert len(policy._bucket_to_leaves) <= 2 * len(policy._bucket_to_num_leaves) + 65


@pytest.mark.parametrize("seed", range(3))
def test_random_stores_in_one_call_evict_as_calls_per_page_do(store_randomly: Callable[..., list],
                                                               seed: int) -> None:
    # One call per store files the run's leaves at its end (a new chain's pages are leaves only
    # until the next arrives); the victims are those of a call per page.
    victims = [store_randomly(PrefixPolicy(24), seed, many) for many in (False, True)]
    assert len(victims[0]) > 100 and victims[0] == victims[1]



def test_a_run_whose_next_page_is_resident_under_another_parent_files_its_page() -> None:
    # b is resident under x; a run names it as a's child. b keeps its own parent, so a has no
    # child and must be a leaf, evictable, though the run's next page names it as parent.
    policy = PrefixPolicy(8)
    policy.on_insert("x")
    policy.on_insert("b", "x")
    policy.on_insert_many([("a", None), ("b", "a")])
    assert sorted(drain(policy)) == ["a", "b", "x"]
