"""The copy routes alone: bytes between a request's pages and the slots placement reserved.

Random pages and a random mapping; the request rows no route names stay as they were.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.pools.page_access import PageRows
from kvtier.store.movers import CopyRoutes, Endpoint
from kvtier.store.pages import Tier

from .conftest import PAGE_BYTES, PartsFactory


def test_pages_go_into_reserved_host_slots_and_back_into_the_rows_named(
        make_parts: PartsFactory) -> None:
    parts = make_parts(host_pages=8, disk_pages=0, with_bytes=True)
    rng = np.random.default_rng(7)
    parts.store("a", "b", "c")  # metadata only: slots reserved and READY, bytes not yet copied
    entries = [parts.entry(n) for n in ("a", "b", "c")]
    pages = rng.integers(0, 256, (4, PAGE_BYTES), dtype=np.uint8)
    stored = [(entries[0], 2), (entries[1], 0), (entries[2], 3)]  # a <- row 2, b <- 0, c <- 3
    assert parts.movers.copy(Endpoint.PAGES, Tier.HOST, stored,
                             PageRows.from_buffers(pages, 4, PAGE_BYTES)) == {}
    out = rng.integers(0, 256, (4, PAGE_BYTES), dtype=np.uint8)
    before = out.copy()
    recalled = [(entries[0], 3), (entries[2], 1)]  # a -> row 3, c -> row 1
    assert parts.movers.copy(Tier.HOST, Endpoint.PAGES, recalled,
                             PageRows.from_buffers(out, 4, PAGE_BYTES, writable=True)) == {}
    np.testing.assert_array_equal(out[3], pages[2])
    np.testing.assert_array_equal(out[1], pages[3])
    np.testing.assert_array_equal(out[[0, 2]], before[[0, 2]])  # untouched


def test_routes_exist_only_between_the_tiers_a_store_has(make_parts: PartsFactory) -> None:
    parts = make_parts(disk_pages=0, with_bytes=True)
    routes = CopyRoutes(parts.tiers.host, None, None)
    parts.store("a")
    with pytest.raises(KeyError):
        routes.move(Tier.HOST, Tier.HBM, [parts.entry("a")])
    with pytest.raises(KeyError):
        routes.copy(Tier.DISK, Endpoint.PAGES, [(parts.entry("a"), 0)],
                    PageRows.from_buffers(np.zeros((1, PAGE_BYTES), np.uint8), 1, PAGE_BYTES,
                                          writable=True))
    assert routes.move(Tier.HOST, Tier.HBM, []) == {}  # nothing to move needs no route
