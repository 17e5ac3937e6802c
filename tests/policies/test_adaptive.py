"""Adaptive policy stories: it evicts leaves only, in the order whose shadow cache hits most, and
so keeps density's wins on scans and recency's when the hot pages move."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from kvtier.policies import AdaptivePolicy, LruPolicy, PrefixPolicy
from kvtier.policies.adaptive import (
    SCORE_HALF_LIFE_CAPACITIES,
    SHADOW_PAGES,
    SWITCH_SIGMAS,
    Expert,
)
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


class GreedyDualFrequency:
    """GreedyDual-Frequency over pages with no parent (every page a leaf), as the leaf order's
    docs state it: a page's priority is L at its last reference plus its use count; the least
    priority leaves first (the older on a tie) and L rises to it."""

    def __init__(self) -> None:
        self.inflation = 0.0
        self.pages: dict[Key, tuple[float, int, int]] = {}  # key -> (priority, time, uses)

    def reference(self, key: Key, time: int) -> None:
        uses = self.pages[key][2] + 1 if key in self.pages else 1
        self.pages[key] = (self.inflation + uses, time, uses)

    def evict(self) -> Key:
        victim = min(self.pages, key=lambda k: self.pages[k][:2])
        self.inflation = max(self.inflation, self.pages.pop(victim)[0])
        return victim

    def forget(self, key: Key) -> None:
        del self.pages[key]


class Lrfu:
    """LRFU over pages with no parent, as the leaf order's docs state it: a page's CRF is the sum
    over its references of 2^(-age / half-life); the least CRF leaves first (the older on a
    tie). Kept as (CRF, time) and aged when compared."""

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self.pages: dict[Key, tuple[float, int]] = {}  # key -> (CRF at time, time)

    def reference(self, key: Key, time: int) -> None:
        crf, then = self.pages.get(key, (0.0, time))
        self.pages[key] = (1.0 + crf * 2.0 ** ((then - time) / self.half_life), time)

    def evict(self) -> Key:
        now = max(time for _, time in self.pages.values())

        def crf_now(key: Key) -> tuple[float, int]:
            crf, time = self.pages[key]
            return crf * 2.0 ** ((time - now) / self.half_life), time

        victim = min(self.pages, key=crf_now)
        del self.pages[victim]
        return victim

    def forget(self, key: Key) -> None:
        del self.pages[key]


class AdaptiveModel:
    """The adaptive policy as its docs state it, for pages with no parent and a tier of at most
    SHADOW_PAGES (shadows see every key): three shadow caches of the tier's capacity, one per
    order, see every reference and evict by their own order; each counts its hits, decayed by
    half over SCORE_HALF_LIFE_CAPACITIES capacities of references; at the first eviction after
    a reference the tier follows the leading order once its lead exceeds SWITCH_SIGMAS standard
    deviations (sqrt of the two scores' sum), and evicts in it. The density order is the prefix
    policy's (pinned by test_prefix.py): a PrefixPolicy stands in for it, fed the tier's calls."""

    def __init__(self, capacity: int) -> None:
        assert capacity <= SHADOW_PAGES
        self.capacity = capacity
        self.expert = Expert.DENSITY
        self.clock = 0
        self.decided_at = -1
        self.num_switches = 0
        self.scores = {expert: (0.0, 0) for expert in Expert}  # (score, clock when scored)
        self.density = PrefixPolicy(capacity)
        self.leaf_orders = {Expert.FREQUENCY: GreedyDualFrequency(), Expert.RECENCY: Lrfu(capacity)}
        self.density_shadow = PrefixPolicy(capacity)
        self.leaf_shadows = {Expert.FREQUENCY: GreedyDualFrequency(),
                             Expert.RECENCY: Lrfu(capacity)}

    def score(self, expert: Expert) -> float:
        score, scored_at = self.scores[expert]
        half_life = SCORE_HALF_LIFE_CAPACITIES * self.capacity
        return score * 2.0 ** ((scored_at - self.clock) / half_life)

    def reference(self, key: Key) -> None:
        self.clock += 1
        for order in self.leaf_orders.values():
            order.reference(key, self.clock)
        if key in self.density_shadow:
            self.scores[Expert.DENSITY] = (self.score(Expert.DENSITY) + 1.0, self.clock)
            self.density_shadow.on_access(key)
        else:
            if len(self.density_shadow) >= self.capacity:
                self.density_shadow.choose_victim(lambda k: True)
            self.density_shadow.on_insert(key)
        for expert, shadow in self.leaf_shadows.items():
            if key in shadow.pages:
                self.scores[expert] = (self.score(expert) + 1.0, self.clock)
            elif len(shadow.pages) >= self.capacity:
                shadow.evict()
            shadow.reference(key, self.clock)

    def miss(self, key: Key) -> None:
        pass

    def hit(self, key: Key) -> None:
        self.density.on_access(key)
        self.reference(key)

    def insert(self, key: Key) -> None:
        self.density.on_insert(key)
        self.reference(key)

    def remove(self, key: Key) -> None:
        self.density.on_remove(key)
        for order in self.leaf_orders.values():
            order.forget(key)

    def evict(self) -> Key:
        if self.decided_at != self.clock:
            self.decided_at = self.clock
            best = max(Expert, key=self.score)
            lead = self.score(best) - self.score(self.expert)
            if lead > SWITCH_SIGMAS * math.sqrt(self.score(best) + self.score(self.expert)):
                self.expert = best
                self.num_switches += 1
        if self.expert is Expert.DENSITY:
            victim = self.density.choose_victim(lambda k: True)
            assert victim is not None
        else:
            victim = self.leaf_orders[self.expert].evict()
            self.density.evict(victim)
        for expert, order in self.leaf_orders.items():
            if expert is not self.expert:
                order.forget(victim)
        return victim


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tail_factor", [2, 10])
def test_random_workload_evicts_as_the_docs_say(drive_against_model, seed: int,
                                                tail_factor: int) -> None:
    """Every 200 references the test sets an order for both (as `test_the_order_followed...`
    does), so each order's victims are compared; in between the tier's own switches must match
    the model's."""
    policy = AdaptivePolicy(16)
    model = AdaptiveModel(16)
    num_steps = 0

    def check(policy: AdaptivePolicy) -> None:
        nonlocal num_steps
        assert policy.expert is model.expert
        num_steps += 1
        if num_steps % 200 == 0:
            policy.expert = model.expert = Expert(num_steps // 200 % len(Expert))

    drive_against_model(policy, model, seed, tail_factor, check=check)


@pytest.mark.parametrize("expert", [Expert.FREQUENCY, Expert.RECENCY])
def test_a_tier_that_follows_a_losing_order_switches_as_the_docs_say(
        drive_against_model, expert: Expert) -> None:
    """A hot set that moves every 20 rounds beside one-off pages: the density shadow leads by
    far, and the tier, set to follow another order, switches to it when the model does."""
    keys = [key for r in range(150)
            for key in [f"hot{r // 20}-{i}" for i in range(10)]
            + [f"once{r}-{i}" for i in range(10)]]
    policy = AdaptivePolicy(16)
    model = AdaptiveModel(16)
    policy.expert = model.expert = expert

    def check(policy: AdaptivePolicy) -> None:
        assert policy.expert is model.expert

    drive_against_model(policy, model, seed=5, tail_factor=1, check=check, keys=keys)
    assert model.num_switches == 1 and model.expert is Expert.DENSITY


@pytest.mark.parametrize("seed", range(3))
def test_random_stores_in_one_call_evict_as_calls_per_page_do(store_randomly: Callable[..., list],
                                                               seed: int) -> None:
    """The orders take turns (each switch to a leaf order files the leaves under the density
    tree's shape); one call per store evicts as a call per page does."""
    victims = []
    for many in (False, True):
        policy = AdaptivePolicy(24)

        def take_turns(step: int, policy: AdaptivePolicy = policy) -> None:
            policy.expert = Expert(step // 30 % len(Expert))

        victims.append(store_randomly(policy, seed, many, take_turns))
    assert len(victims[0]) > 100 and victims[0] == victims[1]


def test_the_shadows_see_a_store_only_at_tidy_off_the_callers_lock() -> None:
    """A store's references wait for `tidy` (which the store calls after its lock): the shadows
    and their scores do not move under the lock. A decision made before `tidy` catches up."""
    policy = AdaptivePolicy(4)
    policy.on_insert_many([("a", None), ("b", "a")])
    policy.on_access("a")
    assert set(policy.shadow_scores().values()) == {0.0}  # a's hit waits in the queue
    policy.tidy()
    assert all(score > 0 for score in policy.shadow_scores().values())  # every shadow hit a
    policy.on_access("b")
    policy.on_insert_many([("c", None), ("d", None)])
    scores = policy.shadow_scores()
    assert policy.choose_victim(lambda k: True) is not None  # catches up: b's hit is counted
    assert all(policy.shadow_scores()[e] > scores[e] for e in Expert)

    # A hit fed late still counts from when it happened: a at tick 5, seen at tick 13.
    policy = AdaptivePolicy(4)
    policy.on_insert_many([(key, None) for key in "abcd"])
    policy.on_access("a")
    policy.on_insert_many([(key, None) for key in "efghijkl"])
    policy.tidy()
    half_life = SCORE_HALF_LIFE_CAPACITIES * 4
    assert policy.shadow_scores()[Expert.DENSITY] == pytest.approx(2 ** (-8 / half_life))


@pytest.mark.parametrize("seed", range(2))
def test_tidy_between_stores_leaves_every_decision_as_it_was(
        store_randomly: Callable[..., list], seed: int) -> None:
    """Shadows fed by `tidy` after each store, or by the decisions themselves: the same
    victims, the same orders followed."""
    victims, experts = [], []
    for tidy in (False, True):
        policy = AdaptivePolicy(24)
        followed: list[Expert] = []

        def each_step(step: int, policy: AdaptivePolicy = policy, tidy: bool = tidy,
                      followed: list[Expert] = followed) -> None:
            if tidy:
                policy.tidy()
            followed.append(policy.expert)

        victims.append(store_randomly(policy, seed, True, each_step))
        experts.append(followed)
    assert len(victims[0]) > 100 and victims[0] == victims[1] and experts[0] == experts[1]


@pytest.mark.parametrize("expert", [Expert.FREQUENCY, Expert.RECENCY])
@pytest.mark.parametrize("many", [False, True])
def test_a_switch_files_the_scores_of_every_reference_made_while_following_density(
        expert: Expert, many: bool) -> None:
    """While the tier follows density, a page referenced once keeps no leaf-order record of
    its own; a switch must still file every page by the scores all its references gave it
    (the models above: use counts, and CRF decayed from each earlier reference), whether its
    hits came one call each or a recall's in one call."""
    rng = random.Random(7)
    capacity = 64
    policy = AdaptivePolicy(capacity)
    model = GreedyDualFrequency() if expert is Expert.FREQUENCY else Lrfu(capacity)
    keys = [f"k{i}" for i in range(48)]
    time = 0  # parentless pages: each reference is its own tick
    for _ in range(400):
        key = keys[min(len(keys) - 1, int(rng.paretovariate(0.7)) - 1)]
        references = 1
        if key in policy and rng.random() < 0.5:
            if many:  # a recall's hits, now and then the page twice
                references = rng.choice((1, 1, 2))
                policy.on_access_many([key] * references)
            else:
                policy.on_access(key)
        elif many:  # a store's run of one page, resident or new
            policy.on_insert_many([(key, None)])
        else:
            policy.on_insert(key, None)
        for _ in range(references):
            time += 1
            model.reference(key, time)
    assert len(policy) < capacity  # nothing evicted yet: every page scored since it entered
    policy.expert = expert
    expected = [model.evict() for _ in range(len(model.pages))]
    assert drain(policy) == expected


@pytest.mark.parametrize("seed", range(2))
def test_a_recalls_hits_in_one_call_score_every_page_as_a_call_per_hit_does(seed: int) -> None:
    """Density's pages, the leaf orders' records and the shadows' queue, compared exactly
    (CRF to the last bit): a recall's hits in one call, a page now and then hit twice in it,
    against one `on_access` per hit."""
    policies = [AdaptivePolicy(256) for _ in range(2)]
    rng = random.Random(seed)
    chains = [[f"c{c}-{i}" for i in range(rng.randrange(1, 9))] for c in range(40)]
    for _ in range(300):
        chain = rng.choice(chains)
        hits = [key for key in chain if key in policies[0]]
        if hits and rng.random() < 0.3:
            hits.insert(rng.randrange(len(hits)), rng.choice(hits))
        hits.append("never stored")
        policies[0].on_access_many(hits)
        for key in hits:
            policies[1].on_access(key)
        for policy in policies:
            policy.on_insert_many([(key, chain[i - 1] if i else None)
                                   for i, key in enumerate(chain) if key not in policy])
    batched, per_hit = policies
    assert batched._leaf_scores.key_to_page == per_hit._leaf_scores.key_to_page
    assert len(batched._leaf_scores.key_to_page) > 20  # pages hit since they entered
    assert batched._density_pages == per_hit._density_pages
    assert list(batched._queued) == list(per_hit._queued) and batched._clock == per_hit._clock
