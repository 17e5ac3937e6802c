"""Leader policy stories: it evicts leaves only, in the order (GreedyDual-Frequency or LRFU) whose
shadow cache hits more lately, keeps the use counts of pages that leave and come back, and does
its shadow work in `tidy`, which the store calls after each store."""

from __future__ import annotations

from kvtier.config import DiskConfig, HostConfig, StoreConfig
from kvtier.keys import Namespace
from kvtier.policies import LeaderPolicy, LruPolicy
from kvtier.policies.base import EvictionPolicy, Key
from kvtier.policies.leaf_order import Order
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier
from kvtier.testing.policies import drain, reference, request


def replay_keys(policy: EvictionPolicy, keys: list[str], fixed: Order | None = None) -> int:
    """Reference each key as a request of its own, tidying after each as the store does (or
    following `fixed` throughout); return the hits."""
    if isinstance(policy, LeaderPolicy) and fixed is not None:
        policy.order = fixed
    resident: set[Key] = set()
    hits = 0
    for key in keys:
        hits += key in policy
        request(policy, [key], resident)
        if fixed is None:
            policy.tidy()
    return hits


def test_a_request_leaves_tail_first_and_older_requests_first() -> None:
    policy = LeaderPolicy(4)
    resident: set[Key] = set()
    request(policy, ["a1", "a2"], resident)
    request(policy, ["b1", "b2"], resident)
    assert policy.order is Order.RECENCY  # nothing learned yet
    assert drain(policy) == ["a2", "a1", "b2", "b1"]


def test_the_order_followed_decides_the_victims() -> None:
    keys = ["a", "a", "a", "b", "d", "b", "d", "b", "d", "c"]
    orders = {}
    for order in Order:
        policy = LeaderPolicy(4)
        resident: set[Key] = set()
        for key in keys:
            request(policy, [key], resident)
        policy.order = order  # no tidy: the order stays as set
        orders[order] = drain(policy)
    # GreedyDual-Frequency: c, used once, first; then three uses each, the oldest first.
    assert orders[Order.FREQUENCY] == ["c", "a", "b", "d"]
    # LRFU (half-life 4 references): a's three uses are old, c's one use is newer.
    assert orders[Order.RECENCY] == ["a", "c", "b", "d"]


def test_a_page_that_leaves_and_returns_keeps_its_uses() -> None:
    policy = LeaderPolicy(2)
    policy.order = Order.FREQUENCY
    for key in ["a", "a", "a", "b"]:
        assert reference(policy, key) == []
    # Pins make a, used three times, leave; then b.
    assert reference(policy, "c", lambda key: key != "b") == ["a"]
    assert reference(policy, "a", lambda key: key == "b") == ["b"]
    assert reference(policy, "c") == []  # c: two uses
    # a came back with its three uses and one more, four: c leaves, not a.
    assert reference(policy, "d") == ["c"]


def test_a_scan_wider_than_the_tier_makes_it_follow_frequency() -> None:
    # A hot pair and two one-off pages a round, in three pages: LRU and LRFU never hit (the
    # one-offs are always newer); GreedyDual-Frequency keeps the pair, its shadow leads, and the
    # tier follows it from its first decision on (one capacity of references).
    keys = [key for r in range(60) for key in ["hot0", "hot1", f"once{r}-0", f"once{r}-1"]]
    assert replay_keys(LruPolicy(3), keys) == 0
    assert replay_keys(LeaderPolicy(3), keys, fixed=Order.RECENCY) == 0
    frequency_hits = replay_keys(LeaderPolicy(3), keys, fixed=Order.FREQUENCY)
    policy = LeaderPolicy(3)
    assert frequency_hits - 2 <= replay_keys(policy, keys) <= frequency_hits
    assert policy.order is Order.FREQUENCY
    scores = policy.shadow_scores()
    assert scores[Order.FREQUENCY] > 0 == scores[Order.RECENCY]


def test_when_the_hot_pages_move_it_keeps_following_recency() -> None:
    # The hot pair changes every ten rounds: counts earned by the old pair hold the frequency
    # order back, LRFU follows each change, leads, and the tier hits as LRFU alone does.
    keys = [key for r in range(60) for key in [f"hot{r // 10}-0", f"hot{r // 10}-1", f"once{r}"]]
    recency_hits = replay_keys(LeaderPolicy(3), keys, fixed=Order.RECENCY)
    assert replay_keys(LeaderPolicy(3), keys, fixed=Order.FREQUENCY) < recency_hits
    policy = LeaderPolicy(3)
    assert replay_keys(policy, keys) == recency_hits
    scores = policy.shadow_scores()
    assert scores[Order.RECENCY] > scores[Order.FREQUENCY] > 0
    assert policy.order is Order.RECENCY


def test_one_call_for_a_store_evicts_as_a_call_per_page_does() -> None:
    # Inserted one by one, each page of a chain is a leaf until the next arrives; inserted as
    # one run, only the run's last page is filed. The eviction order is the same.
    def chains(policy: LeaderPolicy, many: bool) -> list[Key]:
        for chain in [["r", "a1", "a2", "a3"], ["r", "b1", "b2"], ["c1", "c2"]]:
            pairs = [(key, chain[i - 1] if i else None) for i, key in enumerate(chain)
                     if key not in policy]
            if many:
                policy.on_insert_many(pairs)
            else:
                for key, parent in pairs:
                    policy.on_insert(key, parent)
        return drain(policy)

    one_by_one = chains(LeaderPolicy(16), many=False)
    assert chains(LeaderPolicy(16), many=True) == one_by_one
    assert one_by_one == ["a3", "a2", "a1", "b2", "b1", "r", "c2", "c1"]


def test_the_store_feeds_the_shadows_after_each_store() -> None:
    # A metadata-only store: what a store queued for the shadows is fed to them before the
    # store returns (off its lock), so the shadows count the recalled chain's hits.
    config = StoreConfig(host=HostConfig(capacity_bytes=64 << 12, chunk_bytes=64 << 12,
                                         policy="leader", prefault=False),
                         disk=DiskConfig(enabled=False), with_bytes=False)
    namespace = Namespace("leader-test", "bfloat16", "page-first", 16, 1 << 12)
    keys = [bytes([i]) * 16 for i in range(8)]
    with PageStore(config) as store:
        store.store(namespace, keys[:4], None)
        store.recall(namespace, keys[:4], None)
        store.store(namespace, keys[4:], None, parent_key=keys[3])
        policy = store._placement.policy(Tier.HOST, namespace)  # noqa: SLF001
        assert isinstance(policy, LeaderPolicy)
        scores = policy.shadow_scores()  # four hits each, a little decayed since
        assert 3.5 < scores[Order.FREQUENCY] == scores[Order.RECENCY] < 4.0
