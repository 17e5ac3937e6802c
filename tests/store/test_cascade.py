"""The eviction cascade alone, metadata only: hbm -> host -> disk -> dropped, page by page.

Each story names the page that leaves each tier and where it lands (LRU in every tier), and ends
with the integrity walk finding nothing.
"""

from __future__ import annotations

import pytest

from kvtier.errors import StorageError
from kvtier.store.pages import Tier

from .conftest import PartsFactory, key


def test_host_victims_go_to_disk_and_disk_victims_are_dropped_and_forgotten(
        make_parts: PartsFactory) -> None:
    parts = make_parts(host_pages=1, disk_pages=1)
    parts.store("a")
    parts.store("b")  # a: host -> disk
    assert (parts.names_in(Tier.HOST), parts.names_in(Tier.DISK)) == (["b"], ["a"])
    parts.store("c")  # b: host -> disk, which drops a: its last copy
    assert (parts.names_in(Tier.HOST), parts.names_in(Tier.DISK)) == (["c"], ["b"])
    assert key("a") not in {e.key for e in parts.table.values()}
    assert parts.counters.pages_dropped == 1
    assert parts.check() == []


def test_an_hbm_victim_without_a_host_copy_is_demoted_to_host(make_parts: PartsFactory) -> None:
    parts = make_parts(hbm_pages=1, host_pages=2)
    parts.place_in_hbm("a")
    parts.place_in_hbm("b")  # a: hbm -> host
    assert parts.names_in(Tier.HBM) == ["b"]
    assert parts.names_in(Tier.HOST) == ["a"]
    assert parts.counters.demotions == 1
    assert parts.check() == []


def test_a_failed_disk_write_names_its_keys_and_leaves_no_disk_copy(
        make_parts: PartsFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = make_parts(host_pages=1)
    parts.store("a")

    def full_disk(*args: object, **kwargs: object) -> None:
        raise StorageError("no space left on device")

    monkeypatch.setattr(parts.tiers.disk, "write_pages", full_disk)
    failed = parts.cascade.write_disk([(parts.entry("a"), None)])
    assert failed == {key("a"): "no space left on device"}
    assert parts.entry("a").disk is None
    assert parts.tiers.disk.slots.num_used == 0
    assert parts.names_in(Tier.HOST) == ["a"]
    assert parts.check() == []
