"""Placement and the planner alone, metadata only: exact victims, reader counts and promotions.

No `PageStore` and no bytes: the tiers are slot accounting, the steps are driven one by one
(`tests/store/conftest.py`), and each story says which page leaves and where it goes, as LRU
would say it by hand. Every story ends with the integrity walk finding nothing.
"""

from __future__ import annotations

from kvtier.store.pages import PageState, Tier

from .conftest import NAMESPACE, PartsFactory, key


def test_a_full_host_evicts_its_least_recently_used_page_to_disk(make_parts: PartsFactory
                                                                 ) -> None:
    parts = make_parts(host_pages=3)
    parts.store("a", "b", "c")
    parts.finish(parts.recall_plan("a"))  # a is now the most recent: b is the oldest

    parts.store("d")
    assert parts.names_in(Tier.HOST) == ["a", "c", "d"]
    assert parts.names_in(Tier.DISK) == ["b"]  # write-back: demoted on its eviction

    parts.store("e")
    assert parts.names_in(Tier.HOST) == ["a", "d", "e"]
    assert parts.names_in(Tier.DISK) == ["b", "c"]
    assert parts.counters.demotions == 2
    assert parts.check() == []


def test_pinned_pages_and_pages_being_read_are_never_victims(make_parts: PartsFactory) -> None:
    parts = make_parts(host_pages=3)
    parts.store("a", "b", "c", "d")  # a, the oldest, left for disk
    parts.entry("b").pins += 1
    reading_c = parts.recall_plan("c")
    parts.store("e")  # b (pinned) and c (being read) are older than d: d is the one to go
    assert parts.names_in(Tier.HOST) == ["b", "c", "e"]
    assert parts.names_in(Tier.DISK) == ["a", "d"]
    parts.finish(reading_c)
    assert parts.check() == []


def test_a_page_evicted_while_read_keeps_its_slot_until_its_last_reader_leaves(
        make_parts: PartsFactory) -> None:
    parts = make_parts(host_pages=2)
    parts.store("a", "b")
    with parts.lock:  # c's store chooses a, the oldest, and marks it EVICTING ...
        plan = parts.planner.plan_store(NAMESPACE, [key("c")])
        victims = parts.placement.choose_victims(Tier.HOST, plan.to_host)
    assert [v.key for v in victims] == [key("a")]
    assert parts.entry("a").best_tier() is Tier.HOST  # still served while it is demoted ...
    reading_a = parts.recall_plan("a")  # ... so a recall takes a reader on it
    parts.cascade.write_disk([(parts.entry("a"), None)])  # the demotion
    with parts.lock:
        parts.placement.release_victims(Tier.HOST, victims)
    assert parts.entry("a").host.released  # invisible now, its slot kept for the reader
    assert parts.entry("a").best_tier() is Tier.DISK
    assert parts.tiers.host.slots.num_used == 2
    parts.finish(reading_a)  # the last reader frees it
    assert parts.entry("a").host is None
    assert parts.tiers.host.slots.num_used == 1
    assert parts.cascade.reserve(Tier.HOST, plan.to_host).reserved == plan.to_host
    with parts.lock:
        parts.planner.commit_store(plan.to_host_indexed, {})
    assert parts.names_in(Tier.HOST) == ["b", "c"]
    assert parts.check() == []


def test_plan_promotions_picks_the_disk_hits_that_were_served_and_keeps_them_read(
        make_parts: PartsFactory) -> None:
    parts = make_parts(host_pages=2)
    parts.store("a", "b", "c", "d")  # a and b are on disk only, c and d in host
    plan = parts.recall_plan("a", "b", "c")
    assert [e.key for e, _ in plan.from_disk] == [key("a"), key("b")]
    with parts.lock:
        promotion = parts.planner.plan_promotions(plan, {key("b"): "checksum mismatch"})
        released, held = plan.split(promotion.sources)
        parts.planner.finish_recall(released, {key("b"): "checksum mismatch"})
    assert promotion.to_host == [(parts.entry("a"), 0)]  # b failed its check: not promoted
    assert promotion.to_hbm == []  # no hbm tier
    assert held is not None and held.from_disk == [(parts.entry("a"), 0)]
    assert parts.entry("a").disk.readers == 1  # held until the promotion is done
    assert parts.entry("c").host.readers == 0
    assert key("b") not in {e.key for e in parts.table.values() if e.disk is not None
                            and e.disk.state is PageState.READY}  # dropped from disk
    parts.finish(held)
    assert parts.entry("a").disk.readers == 0
    assert parts.check() == []
