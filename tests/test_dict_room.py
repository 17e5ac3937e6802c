"""Dicts rebuilt at the size their keys need once most of their keys went, in place."""

from __future__ import annotations

import sys
from collections import OrderedDict
from types import SimpleNamespace

from kvtier.dict_room import MAX_KEYS_TO_REBUILD, is_oversized, shrink, shrink_attributes
from kvtier.store.page_table import PageTable


def emptied(table: dict, num_keys: int, num_left: int) -> dict:
    """`table` filled with `num_keys` keys, then all but the last `num_left` deleted."""
    for number in range(num_keys):
        table[number.to_bytes(16, "big")] = number
    for number in range(num_keys - num_left):
        del table[number.to_bytes(16, "big")]
    return table


def test_an_emptied_dict_is_rebuilt_small_in_place_with_its_keys_in_order() -> None:
    table = emptied(OrderedDict(), 50_000, 100)
    table.move_to_end((49_950).to_bytes(16, "big"), last=False)
    before = list(table.items())
    size_bytes = sys.getsizeof(table)
    given_back = shrink(table)
    assert given_back > 0 and sys.getsizeof(table) == size_bytes - given_back
    assert sys.getsizeof(table) < size_bytes / 20
    assert list(table.items()) == before  # same object, same keys, same order


def test_a_dict_that_kept_most_of_its_keys_is_left_alone() -> None:
    table = emptied({}, 50_000, 20_000)
    assert not is_oversized(table)
    assert shrink(table) == 0


def test_a_dict_with_too_many_keys_left_to_rebuild_at_once_is_left_alone() -> None:
    # The rebuild holds the caller's lock: its work is bounded whatever the table's history.
    table = emptied({}, 400_000, MAX_KEYS_TO_REBUILD + 1)
    assert not is_oversized(table) and shrink(table) == 0


def test_the_page_table_shrinks_without_reporting_its_pages_gone() -> None:
    reported: list[object] = []
    table = PageTable()
    emptied(table, 30_000, 10)
    table.observer = SimpleNamespace(page_gone=reported.append, shrink=lambda: 0)
    assert table.shrink() > 0
    assert reported == [] and len(table) == 10


def test_shrink_attributes_covers_plain_and_slotted_attributes() -> None:
    class Slotted:
        __slots__ = ("pages",)

    owner, slotted = SimpleNamespace(pages=emptied({}, 30_000, 0)), Slotted()
    slotted.pages = emptied({}, 30_000, 0)
    assert shrink_attributes(owner) > 0 and shrink_attributes(slotted) > 0
    assert not is_oversized(owner.pages) and not is_oversized(slotted.pages)
