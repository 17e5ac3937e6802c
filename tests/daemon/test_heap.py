"""The daemon's garbage collection (issue #24): survivors are frozen out of the collector's
walks, and the rare sweep still finds garbage cycles among them."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kvtier.daemon.heap import SWEEP_INTERVAL_S, HeapKeeper


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_survivors_leave_the_collectors_walks() -> None:
    page_table = [Node() for _ in range(20_000)]
    HeapKeeper().freeze_survivors()
    walked = sum(len(gc.get_objects(generation)) for generation in range(3))
    assert walked < 1_000, f"a collection would still walk {walked} objects"
    assert gc.get_freeze_count() >= len(page_table)


def test_the_sweep_collects_a_frozen_garbage_cycle() -> None:
    now = [0.0]
    keeper = HeapKeeper(clock=lambda: now[0])
    first, second = Node(), Node()
    first.other, second.other = second, first
    alive = weakref.ref(first)
    keeper.freeze_survivors()
    del first, second
    keeper.tend()
    gc.collect()
    assert alive() is not None, "no test: the cycle was collected before any sweep"
    now[0] += SWEEP_INTERVAL_S
    keeper.tend()
    assert alive() is None, "the sweep left a garbage cycle"
