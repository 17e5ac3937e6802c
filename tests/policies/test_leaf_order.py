"""Leaf orders as stories: GreedyDual-Frequency keeps used pages until their counts age out, LRFU
weighs uses by recency, and both evict leaves only, a request's tail first."""

from __future__ import annotations

import random

import pytest

from kvtier.policies.leaf_order import LeafOrder, Order


def drain(leaves: LeafOrder, order: Order) -> list[str]:
    evicted = []
    while (victim := leaves.evict_leaf(order, lambda k: True)) is not None:
        evicted.append(victim)
    return evicted


@pytest.mark.parametrize("order", list(Order))
def test_a_request_leaves_tail_first_and_parents_after_children(order: Order) -> None:
    leaves = LeafOrder(8, (order,))
    for index, key in enumerate(["a1", "a2", "a3"]):
        leaves.reference(key, ["a1", "a2", "a3"][index - 1] if index else None)
    leaves.reference("b1", None)
    leaves.reference("b1", None)  # used twice: both orders keep it past a
    assert drain(leaves, order) == ["a3", "a2", "a1", "b1"]


def test_frequency_keeps_used_pages_until_the_floor_catches_up() -> None:
    leaves = LeafOrder(8, (Order.FREQUENCY,))
    for key, uses in [("a", 3), ("b", 1), ("c", 2)]:
        for _ in range(uses):
            leaves.reference(key, None)
    # Priorities L + uses: a 3, b 1, c 2. b leaves first and lifts L to 1.
    assert leaves.evict_leaf(Order.FREQUENCY, lambda k: True) == "b"
    leaves.reference("d", None)  # 1 + 1 = 2: ties with c, which is older
    assert leaves.evict_leaf(Order.FREQUENCY, lambda k: True) == "c"
    leaves.reference("e", None)  # L is 2: a new page ranks with a's three old uses
    assert drain(leaves, Order.FREQUENCY) == ["d", "a", "e"]


def test_recency_weighs_uses_by_how_recent_they_are() -> None:
    # Half-life of one capacity, 4 ticks: a's two uses (ticks 1, 2) outweigh b, c and d, used
    # once since, but not e, used once three ticks after d. LRU would drop a first, LFU last.
    leaves = LeafOrder(4, (Order.RECENCY,))
    for key in ["a", "a", "b", "c", "d", "e"]:
        leaves.reference(key, None)
    assert drain(leaves, Order.RECENCY) == ["b", "c", "d", "a", "e"]


@pytest.mark.parametrize("order", list(Order))
def test_pinned_leaves_are_skipped_and_keep_their_place(order: Order) -> None:
    leaves = LeafOrder(8, (order,))
    leaves.reference("a1", None)
    leaves.reference("a2", "a1")
    leaves.reference("b1", None)
    assert leaves.evict_leaf(order, lambda k: k != "a2") == "b1"
    assert leaves.evict_leaf(order, lambda k: k != "a2") is None  # a1 holds a child
    assert drain(leaves, order) == ["a2", "a1"]


def test_a_parent_referenced_after_its_child_is_not_a_leaf() -> None:
    leaves = LeafOrder(8, tuple(Order))
    leaves.reference("c", "b")
    leaves.reference("b", "a")
    leaves.reference("a", None)
    assert not leaves.is_leaf("a") and leaves.is_leaf("c")
    assert drain(leaves, Order.FREQUENCY) == ["c", "b", "a"]


@pytest.mark.parametrize("seed", range(3))
def test_heaps_stay_bounded_and_every_leaf_stays_evictable(seed: int) -> None:
    rng = random.Random(seed)
    leaves = LeafOrder(64, tuple(Order))
    for number in range(2000):
        chain = [f"root{rng.randrange(4)}"] + [f"r{number}-{i}" for i in range(rng.randint(1, 9))]
        for index, key in enumerate(chain):
            if key not in leaves:
                while len(leaves) >= 64:
                    assert leaves.evict_leaf(Order(number % 2), lambda k: True) is not None
            leaves.reference(key, chain[index - 1] if index else None)
        assert leaves.num_filed() <= 2 * (2 * leaves.num_leaves() + 64) + 2
    resident = len(leaves)
    assert len(drain(leaves, Order.RECENCY)) == resident


def test_a_change_of_order_files_the_current_leaves_in_the_new_one() -> None:
    leaves = LeafOrder(4, (Order.FREQUENCY,))
    for key in ["a", "a", "b", "c", "d", "e"]:
        leaves.reference(key, None)
    leaves.set_orders((Order.RECENCY,))  # the story of test_recency_weighs_uses...
    assert leaves.evict_leaf(Order.FREQUENCY, lambda k: True) is None  # no longer filed
    assert drain(leaves, Order.RECENCY) == ["b", "c", "d", "a", "e"]


@pytest.mark.parametrize("order", list(Order))
def test_a_run_whose_next_page_is_resident_under_another_parent_files_its_page(
        order: Order) -> None:
    # b is resident under x; a run names it as a's child. b keeps its own parent, so a has no
    # child and must be a leaf, evictable, though the run's next page names it as parent.
    leaves = LeafOrder(8, (order,))
    leaves.reference("x", None)
    leaves.reference("b", "x")
    leaves.reference_many([("a", None), ("b", "a")])
    assert sorted(drain(leaves, order)) == ["a", "b", "x"]
