"""Adaptive policy stories: it evicts leaves only, in the order whose shadow cache hits most, and
so keeps density's wins on scans and recency's when the hot pages move."""

from __future__ import annotations

import random

import pytest

from kvtier.policies import AdaptivePolicy, LruPolicy, PrefixPolicy
from kvtier.policies.adaptive import Expert
from kvtier.policies.base import EvictionPolicy, Key
from kvtier.testing.policies import drain, request


def replay_keys(policy: EvictionPolicy, keys: list[str]) -> int:
    """Reference each key as a request of its own; return the hits."""
    resident: set[Key] = set()
    hits = 0
    for key in keys:
        hits += key in policy
        request(policy, [key], resident)
    return hits


def test_with_nothing_learned_a_request_leaves_tail_first_and_older_requests_first() -> None:
    policy = AdaptivePolicy(4)
    resident: set[Key] = set()
    request(policy, ["a1", "a2"], resident)
    request(policy, ["b1", "b2"], resident)
    assert policy.expert is Expert.DENSITY
    assert drain(policy) == ["a2", "a1", "b2", "b1"]


def test_a_shared_root_stays_while_any_child_is_resident() -> None:
    policy = AdaptivePolicy(4)
    resident: set[Key] = set()
    for leaf in ["a", "b", "c"]:
        request(policy, ["root", leaf], resident)
    request(policy, ["root", "d"], resident)
    assert resident == {"root", "b", "c", "d"}
    assert drain(policy)[-1] == "root"


def test_a_scan_wider_than_the_tier_keeps_the_density_order() -> None:
    # A hot pair and two one-off pages a round, in three pages: LRU never hits; density learns
    # that one-off pages never return and keeps the pair, and the shadows agree.
    keys = [key for r in range(60) for key in ["hot0", "hot1", f"once{r}-0", f"once{r}-1"]]
    policy = AdaptivePolicy(3)
    assert replay_keys(LruPolicy(3), keys) == 0
    assert replay_keys(policy, keys) == replay_keys(PrefixPolicy(3), keys) > 60
    assert policy.expert is Expert.DENSITY
    scores = policy.shadow_scores()
    assert scores[Expert.DENSITY] > scores[Expert.FREQUENCY] == scores[Expert.RECENCY] == 0


def test_a_lead_within_the_noise_of_few_hits_keeps_the_order() -> None:
    # The hot pair changes every ten rounds: at three pages the recency shadow leads a little
    # (it follows each change at once), but by fewer hits than three standard deviations of so
    # few, so the tier keeps the density order and hits as the prefix policy does.
    keys = [key for r in range(60) for key in [f"hot{r // 10}-0", f"hot{r // 10}-1", f"once{r}"]]
    policy = AdaptivePolicy(3)
    assert replay_keys(policy, keys) == replay_keys(PrefixPolicy(3), keys)
    scores = policy.shadow_scores()
    assert scores[Expert.RECENCY] > scores[Expert.DENSITY]
    assert policy.expert is Expert.DENSITY


@pytest.mark.parametrize(("expert", "order"), [
    # GreedyDual-Frequency: c, used once, first; then three uses each, the oldest first.
    (Expert.FREQUENCY, ["c", "a", "b", "d"]),
    # LRFU (half-life 4 references): a's three uses are old, c's one use is newer.
    (Expert.RECENCY, ["a", "c", "b", "d"]),
])
def test_the_order_followed_decides_the_victims(expert: Expert, order: list[str]) -> None:
    policy = AdaptivePolicy(4)
    resident: set[Key] = set()
    for key in ["a", "a", "a", "b", "d", "b", "d", "b", "d", "c"]:
        request(policy, [key], resident)
    policy.expert = expert  # no shadow has a significant lead: the order stays as set
    assert drain(policy) == order


def test_pinned_leaves_are_skipped_and_parents_of_pinned_leaves_stay() -> None:
    policy = AdaptivePolicy(8)
    request(policy, ["a1", "a2"], set())
    request(policy, ["b1"], set())
    assert policy.choose_victim(lambda k: k != "a2") == "b1"
    assert policy.choose_victim(lambda k: k != "a2") is None  # a1 has a resident child
    assert drain(policy) == ["a2", "a1"]


def test_a_child_of_an_evicted_page_is_refused_and_so_are_its_children() -> None:
    policy = AdaptivePolicy(2)
    resident: set[Key] = set()
    request(policy, ["a1"], resident)
    request(policy, ["b1", "b2"], resident)
    assert resident == {"b1", "b2"}
    assert not policy.admit("a2", "a1")
    assert not policy.admit("a3", "a2")
    assert policy.admit("c1", None)


def test_the_parent_of_a_page_being_stored_is_not_evicted() -> None:
    policy = AdaptivePolicy(3)
    resident: set[Key] = set()
    request(policy, ["a1", "a2"], resident)
    request(policy, ["b1"], resident)
    assert policy.admit("a3", "a2") and policy.admit("a4", "a3")
    assert policy.choose_victim(lambda k: True) == "b1"  # a2 is older, but a3 needs it
    assert policy.choose_victim(lambda k: True) is None
    policy.on_insert("a3", "a2")
    assert not policy.admit("a5", "a4")  # a4 was abandoned
    assert drain(policy) == ["a3", "a2", "a1"]


@pytest.mark.parametrize("expert", [Expert.FREQUENCY, Expert.RECENCY])
def test_a_store_that_found_no_room_holds_its_parent_only_until_the_next_store(
        expert: Expert) -> None:
    policy = AdaptivePolicy(2)
    policy.expert = expert  # no shadow has hit yet: the order stays as set
    request(policy, ["a1", "a2"], set())
    assert policy.admit("a3", "a2")
    assert policy.choose_victim(lambda k: False) is None  # all pinned: a3's store fails
    assert policy.admit("b1", None)  # the next store: a3 was abandoned
    assert drain(policy) == ["a2", "a1"]


def test_a_removed_key_is_forgotten_and_its_parent_is_a_leaf_again() -> None:
    policy = AdaptivePolicy(4)
    request(policy, ["a1", "a2"], set())
    policy.on_remove("a2")
    assert "a2" not in policy and len(policy) == 1
    assert drain(policy) == ["a1"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", [4, 16, 64])
def test_random_requests_keep_every_resident_parent_resident(seed: int, capacity: int) -> None:
    rng = random.Random(seed)
    policy = AdaptivePolicy(capacity)
    resident: set[Key] = set()
    parent_of: dict[Key, Key | None] = {}
    conversations = [[f"c{c}-0"] for c in range(12)]
    for step in range(600):
        if step % 150 == 0:  # the hot conversations move: the orders take turns
            rng.shuffle(conversations)
        chain = conversations[min(len(conversations) - 1, int(rng.paretovariate(1.0)) - 1)]
        if rng.random() < 0.5 and len(chain) < capacity + 4:
            chain.append(f"{chain[0]}-{len(chain)}")
        for index, key in enumerate(chain):
            parent_of[key] = chain[index - 1] if index else None
        pinned = set(rng.sample(sorted(resident), min(len(resident), 2)))
        policy.expert = Expert(step // 7 % len(Expert))  # every order takes its turns
        request(policy, list(chain), resident, lambda k: k not in pinned)
        assert len(policy) == len(resident) <= capacity
        assert all(k in policy for k in resident)
        assert all(parent_of[k] is None or parent_of[k] in resident for k in resident)
    # A new store begins (a chain's tail past the tier was admitted, never inserted: its
    # parent is held until then); every resident page can still be evicted.
    assert policy.admit("next", None)
    assert sorted(drain(policy)) == sorted(resident)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tail_factor", [2, 10])
def test_resident_set_matches_a_simulated_cache(drive_against_model, seed: int,
                                                tail_factor: int) -> None:
    drive_against_model(AdaptivePolicy(16), seed, tail_factor)


@pytest.mark.parametrize("seed", range(3))
def test_pinned_keys_are_never_victims(drive_with_random_pins, seed: int) -> None:
    drive_with_random_pins(AdaptivePolicy(16), seed)
