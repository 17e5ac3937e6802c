"""LRU stories: each asserts the exact order in which keys leave."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable

import pytest

from kvtier.policies import Key, LruPolicy
from kvtier.testing.policies import drain, reference


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


class LruModel:
    """Plain LRU, the documented order for keys stored without a parent: an OrderedDict from
    least recent (front) to most recent (back)."""

    def __init__(self) -> None:
        self._keys: OrderedDict[Key, None] = OrderedDict()

    def miss(self, key: Key) -> None:
        pass

    def hit(self, key: Key) -> None:
        self._keys.move_to_end(key)

    def insert(self, key: Key) -> None:
        self._keys[key] = None

    def remove(self, key: Key) -> None:
        del self._keys[key]

    def evict(self) -> Key:
        return self._keys.popitem(last=False)[0]


@pytest.mark.parametrize("capacity", [1, 2, 7, 32])
def test_random_workload_evicts_as_a_plain_lru(capacity: int, drive_against_model) -> None:
    drive_against_model(LruPolicy(capacity), LruModel(), seed=1234 + capacity, tail_factor=10)


def insert_chain(policy: LruPolicy, keys: str, parent: Key | None = None) -> None:
    """Insert `keys` as consecutive pages of one prefix, the way a store of one request does."""
    for key in keys:
        policy.on_insert(key, parent)
        parent = key


def test_pages_used_together_leave_deepest_first() -> None:
    lru = LruPolicy(8)
    insert_chain(lru, "abc")  # one request: a is the first page, c the last
    lru.on_insert("x")
    insert_chain(lru, "pq")
    assert drain(lru) == ["c", "b", "a", "x", "q", "p"]


def test_a_hit_on_a_prefix_moves_it_after_its_unused_tail() -> None:
    lru = LruPolicy(8)
    insert_chain(lru, "abcd")
    for key in "ab":  # a later request reuses the first two pages only
        lru.on_access(key)
    assert drain(lru) == ["d", "c", "b", "a"]


def test_a_chain_continued_after_an_eviction_stays_one_use() -> None:
    """Hits on a prefix, room made, then the request's new pages stored under it: the new pages
    join the hits' group, so the prefix outlives them (no stranded page)."""
    lru = LruPolicy(3)
    insert_chain(lru, "abc")
    lru.on_access("a")
    lru.on_access("b")
    assert lru.choose_victim(lambda k: True) == "c"
    lru.on_insert("d", "b")
    assert drain(lru) == ["d", "b", "a"]


def test_pinned_deep_page_keeps_its_place_in_its_group() -> None:
    lru = LruPolicy(4)
    insert_chain(lru, "abc")
    assert lru.choose_victim(lambda k: k != "c") == "b"
    assert drain(lru) == ["c", "a"]


def test_random_prefix_requests_never_strand_a_page() -> None:
    """Requests share prefixes of a few chains and are stored as PageStore does (room for the
    whole run, then the run); after each one every resident page's parent is resident, and
    repeated hits do not grow the bookkeeping past a bound."""
    rng = random.Random(7)
    lru = LruPolicy(20)
    chains = [[f"{c}.{i}" for i in range(lru.capacity_pages)] for c in range(6)]
    parent_of = {k: (chain[i - 1] if i else None) for chain in chains for i, k in enumerate(chain)}
    for _ in range(3000):
        chain = rng.choice(chains)[:rng.randint(1, lru.capacity_pages)]
        present = 0
        while present < len(chain) and chain[present] in lru:
            present += 1
        for key in chain[:present]:
            lru.on_access(key)
        while len(lru) + len(chain) - present > lru.capacity_pages:
            assert lru.choose_victim(lambda k: True) is not None
        for key in chain[present:]:
            lru.on_insert(key, parent_of[key])
        resident = [k for k in parent_of if k in lru]
        assert len(resident) == len(lru)
        assert all(parent_of[k] is None or parent_of[k] in lru for k in resident)
        num_entries = sum(len(keys) for keys in lru._groups.values())
        assert num_entries <= 2 * len(lru) + 65


def test_a_chain_resumed_after_other_calls_keeps_its_prefix_oldest_last() -> None:
    """A daemon's clients interleave: one request's hits, another request's store, then the first
    request's store under its last hit. The resumed chain's ancestors join its use, so the older
    request's pages go first and the resumed prefix leaves deepest first."""
    lru = LruPolicy(16)
    insert_chain(lru, "abc")
    for key in "ab":  # request 1 hits a, b
        lru.on_access(key)
    insert_chain(lru, "xy")  # request 2 stores meanwhile
    lru.on_insert("d", "b")  # request 1 stores d under b
    assert drain(lru) == ["c", "y", "x", "d", "b", "a"]


def test_parent_keys_that_form_a_cycle_do_not_hang_a_touch() -> None:
    lru = LruPolicy(4)
    lru.on_insert("a", "b")  # a client's keys may claim any parent
    lru.on_insert("b", "a")
    lru.on_insert("x")
    lru.on_access("a")  # a's parent b is resident and not the last key: walks b -> a -> b
    assert sorted(drain(lru)) == ["a", "b", "x"]


@pytest.mark.parametrize("seed", range(3))
def test_victims_one_after_another_are_those_of_a_choice_each(
        store_randomly: Callable[..., list], seed: int) -> None:
    """Victims taken from one `victims` iterator per store (a page removed between two now and
    then, the iterator closed once there is room) are those of a `choose_victim` each."""
    victims = [store_randomly(LruPolicy(24), seed, many) for many in (False, True)]
    assert len(victims[0]) > 100 and victims[0] == victims[1]
