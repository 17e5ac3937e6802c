"""Pins bounded by a share of each tier: a greedy lease is refused, a victim's pages keep room.

Host: 8 pages of 4 KiB, no disk, LRU. A share of 25% lets one holder pin 2 pages there.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import QuotaError
from kvtier.keys import Namespace
from kvtier.store.pages import Tier

SHARE = 0.25


def test_a_greedy_lease_is_refused_and_the_victims_pages_keep_their_room(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=8, disk_enabled=False)
    greedy = Namespace("greedy-model", "bfloat16", "page-first", 16, 4096)
    greedy_keys = make_keys(8, seed=1)
    assert store.store(greedy, greedy_keys, make_pages(8, seed=1)).ok

    with pytest.raises(QuotaError, match=r"daemon\.max_pinned_share"):
        store.pin(greedy, greedy_keys, 60.0, (), SHARE)  # every page of the host tier
    first = store.pin(greedy, greedy_keys[:2], 60.0, (), SHARE)  # 2 of 8: its whole share
    assert first.pinned == greedy_keys[:2]
    with pytest.raises(QuotaError, match="past this client's share of 25%"):
        store.pin(greedy, greedy_keys[2:3], 60.0, {first.lease_id}, SHARE)
    again = store.pin(greedy, greedy_keys[:2], 60.0, {first.lease_id}, SHARE)  # nothing new
    assert store.stats().num_leases == 2

    # The victim stores 6 pages: they take the greedy client's unpinned ones' room, and stay.
    victim_keys, victim_pages = make_keys(6, seed=2), make_pages(6, seed=2)
    result = store.store(namespace, victim_keys, victim_pages)
    assert result.ok, result.failed
    out = np.zeros_like(victim_pages)
    assert store.recall(namespace, victim_keys, out).recalled == victim_keys
    assert np.array_equal(out, victim_pages)
    assert store.lookup(greedy, greedy_keys).tiers == [Tier.HOST] * 2 + [None] * 6

    store.unpin(first.lease_id)
    store.unpin(again.lease_id)
    assert store.pin(greedy, greedy_keys[:2], 60.0, (), SHARE).pinned == greedy_keys[:2]
    assert store.check() == []


def test_without_a_share_a_lease_may_pin_every_page(make_store, make_pages, make_keys) -> None:
    """The store's own default (a share of 1): the daemon passes its setting."""
    store = make_store(host_pages=8, disk_enabled=False)
    greedy = Namespace("greedy-model", "bfloat16", "page-first", 16, 4096)
    keys = make_keys(8, seed=3)
    assert store.store(greedy, keys, make_pages(8, seed=3)).ok
    assert store.pin(greedy, keys, 60.0).pinned == keys
    assert store.check() == []
