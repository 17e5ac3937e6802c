"""Reuse statistics: page classes, the bounded history, and the hit density table it learns."""

from __future__ import annotations

import pytest

from kvtier.policies.reuse import MAX_DEPTH_OCTAVE, MAX_USES, ReuseHistory, page_class


def test_page_classes_tell_uses_and_depth_octaves_apart_up_to_their_caps() -> None:
    assert page_class(1, 0) != page_class(2, 0) != page_class(1, 1)
    assert page_class(1, 2) == page_class(1, 3)  # one octave: depths 2-3
    assert page_class(1, 3) != page_class(1, 4)
    assert page_class(MAX_USES, 0) == page_class(MAX_USES + 5, 0)
    deepest = 1 << (MAX_DEPTH_OCTAVE - 1)
    assert page_class(1, deepest) == page_class(1, 100 * deepest)


def test_the_history_counts_uses_remembers_depths_and_drops_its_oldest_key() -> None:
    history = ReuseHistory(capacity_keys=2, horizon=100)
    history.reference("a", 1, depth=0)
    history.reference("a", 2, depth=0)
    history.reference("b", 3, depth=5)
    assert (history.uses("a"), history.uses("b"), history.depth("b")) == (2, 1, 5)
    history.reference("c", 4, depth=0)  # "a" is the oldest
    assert "a" not in history and history.uses("a") == 0 and history.depth("a") is None
    history.forget("b")
    assert "b" not in history and len(history) == 1


def test_a_record_keeps_late_times_deep_pages_and_many_uses() -> None:
    """Each key's record is packed in an int: a late clock and a deep page read back as given,
    a return is counted at its true distance, and a depth past the field's width keeps its
    class."""
    history = ReuseHistory(capacity_keys=4, horizon=100)
    late, deep = 1 << 50, 10**6
    history.reference("a", late, depth=deep)
    cls = history.reference("a", late + 9, depth=deep)
    assert (history.uses("a"), history.depth("a")) == (2, deep)
    assert cls == page_class(2, deep)
    returns = history._returns[page_class(1, deep)]
    assert returns[history.age_bin(9)] == 1 and sum(returns) == 1
    history.reference("c", 5, depth=(1 << 40))
    assert history.depth("c") >= 1 << 23 and history.uses("c") == 1  # saturates, same class
    assert history.reference("c", 6, depth=(1 << 40)) == page_class(2, 1 << 40)


def test_age_bins_cover_the_horizon_and_grow_with_age() -> None:
    history = ReuseHistory(capacity_keys=10, horizon=1000)
    bins = [history.age_bin(age) for age in range(2000)]
    assert bins[0] == 0 and bins == sorted(bins)
    assert bins[-1] == history.num_bins - 1 == history.age_bin(10**9)
    # Four bins to a doubling: ages 100-199 span about four bins, 500-999 about four too.
    assert 3 <= bins[199] - bins[100] <= 5 and 3 <= bins[999] - bins[500] <= 5


def test_before_any_evidence_every_class_and_age_is_worth_the_same() -> None:
    table = ReuseHistory(capacity_keys=10, horizon=100).hit_densities()
    assert len({value for row in table for value in row}) == 1


def test_a_class_that_comes_back_is_denser_than_one_that_never_does() -> None:
    history = ReuseHistory(capacity_keys=1000, horizon=1000)
    time = 0
    for round_ in range(50):  # every page used twice comes back ten ticks later; no other
        for key in (f"once-{round_}", f"twice-{round_}"):
            time += 1
            history.reference(key, time, depth=0)
        time += 10
        history.reference(f"twice-{round_}", time, depth=0)
    table = history.hit_densities()
    assert table[page_class(1, 0)][0] > 0
    assert table[page_class(2, 0)][0] < table[page_class(1, 0)][0] / 10  # used twice: done


def test_a_page_whose_return_comes_late_is_worth_more_once_it_has_waited() -> None:
    history = ReuseHistory(capacity_keys=1000, horizon=1000)
    for round_ in range(100):  # each page comes back once, exactly 200 ticks later
        history.reference(round_, 1000 * round_, depth=0)
        history.reference(round_, 1000 * round_ + 200, depth=0)
    densities = history.hit_densities()[page_class(1, 0)]
    fresh, waited = densities[history.age_bin(0)], densities[history.age_bin(150)]
    assert waited > 2 * fresh  # a quarter of the wait is left (bins blur it a little)
    assert densities[history.age_bin(400)] < fresh  # past its return: it will not come


@pytest.mark.parametrize("horizon", [1, 3, 64, 10_000])
def test_the_table_has_a_row_per_class_and_a_density_per_age_bin(horizon: int) -> None:
    history = ReuseHistory(capacity_keys=50, horizon=horizon)
    for time in range(200):
        history.reference(time % 7, time, depth=time % 5)
    table = history.hit_densities()
    assert all(len(row) == history.num_bins for row in table)
    assert all(value >= 0 for row in table for value in row)


def test_a_return_that_leads_to_more_returns_is_worth_more_than_a_last_one() -> None:
    """Two histories where half the new pages come back 10 ticks after their first use and the
    other half never: in one the returning pages are done then, in the other each comes back
    every 10 ticks for 8 more uses. A first return is worth its own hit plus what the denser
    class it leads into yields, so the same first-return statistics give the second history's
    fresh pages the higher density."""
    def fresh_density(more_returns: int) -> float:
        history = ReuseHistory(capacity_keys=10_000, horizon=1000)
        time = 0
        for round_ in range(60):
            time += 100
            history.reference(("once", round_), time, depth=0)
            for use in range(2 + more_returns):
                history.reference(("again", round_), time + 10 * use, depth=0)
            time += 10 * (2 + more_returns)
        return history.hit_densities()[page_class(1, 0)][history.age_bin(0)]

    assert fresh_density(8) > 1.5 * fresh_density(0)


def test_a_subclass_that_refines_the_shape_gets_a_class_per_shape() -> None:
    """Pages told apart by a mark in their key: the marked ones come back ten ticks later, the
    others never. A history whose shape adds the mark learns the two apart within one use count
    and depth."""
    depth_shapes = ReuseHistory.num_shapes

    class MarkedHistory(ReuseHistory):
        num_shapes = 2 * depth_shapes

        def shape(self, key, depth: int) -> int:
            return super().shape(key, depth) + depth_shapes * (key[0] == "marked")

    history = MarkedHistory(capacity_keys=1000, horizon=1000)
    time = 0
    for round_ in range(50):
        for mark in ("marked", "plain"):
            time += 1
            history.reference((mark, round_), time, depth=0)
        time += 10
        history.reference(("marked", round_), time, depth=0)
    table = history.hit_densities()
    assert len(table) == (MAX_USES + 1) * history.num_shapes
    first_use = 1 * history.num_shapes  # one use, depth 0, plain
    plain, marked = (table[first_use + shift][history.age_bin(0)] for shift in (0, depth_shapes))
    assert marked > 10 * plain
