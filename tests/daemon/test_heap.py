"""The daemon's garbage collection (issue #24): survivors are frozen out of the collector's
walks; a sweep of the whole heap comes only where garbage is evident (a watched object outlived
its grace) or as the hourly backstop, and finds garbage cycles among frozen objects."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator

import pytest

from kvtier.daemon.heap import (
    MIN_SWEEP_INTERVAL_S,
    SWEEP_INTERVAL_S,
    WATCH_GRACE_S,
    HeapKeeper,
    give_arena_memory_back,
    give_memory_back,
)


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


def frozen_cycle() -> tuple[Node, weakref.ref[Node]]:
    """A garbage cycle's first node (still referenced by the caller) among frozen objects."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return first, weakref.ref(first)


def test_a_watched_object_held_by_a_cycle_calls_a_sweep_after_its_grace() -> None:
    now = [0.0]
    keeper = HeapKeeper(clock=lambda: now[0])
    now[0] += MIN_SWEEP_INTERVAL_S
    first, alive = frozen_cycle()
    keeper.freeze_survivors()
    keeper.watch(first)
    del first
    keeper.tend()  # watched just now: within its grace
    assert alive() is not None and keeper.num_sweeps == 0
    now[0] += WATCH_GRACE_S
    keeper.tend()
    assert alive() is None and keeper.num_sweeps == 1
    now[0] += MIN_SWEEP_INTERVAL_S
    keeper.tend()
    assert keeper.num_sweeps == 1, "nothing watched is left: no sweep"


def test_what_refcounting_frees_calls_no_sweep_before_the_backstop() -> None:
    now = [0.0]
    keeper = HeapKeeper(clock=lambda: now[0])
    for _ in range(100):  # connections that closed cleanly
        released = Node()
        keeper.watch(released)
        del released
    keeper.watch((1, 2))  # takes no weak reference: ignored
    now[0] += SWEEP_INTERVAL_S - 1
    keeper.tend()
    assert keeper.num_sweeps == 0
    now[0] += 1
    keeper.tend()
    assert keeper.num_sweeps == 1


def test_sweeps_are_spaced_whatever_the_churn_and_a_leak_is_forgotten() -> None:
    now = [0.0]
    keeper = HeapKeeper(clock=lambda: now[0])
    leaked = [Node()]  # alive for good: a sweep cannot free it
    keeper.watch(leaked[0])
    now[0] += MIN_SWEEP_INTERVAL_S
    keeper.tend()
    assert keeper.num_sweeps == 1
    first, alive = frozen_cycle()
    keeper.freeze_survivors()
    keeper.watch(first)
    del first
    now[0] += WATCH_GRACE_S
    keeper.tend()  # evident, but the last sweep was a grace ago, not a minute
    assert keeper.num_sweeps == 1 and alive() is not None
    now[0] += MIN_SWEEP_INTERVAL_S
    keeper.tend()
    assert keeper.num_sweeps == 2 and alive() is None
    now[0] += MIN_SWEEP_INTERVAL_S
    keeper.tend()
    assert keeper.num_sweeps == 2, "the leak was watched again after a sweep could not free it"


@pytest.mark.skipif(sys.getallocatedblocks() == 0, reason="PYTHONMALLOC=malloc: no pymalloc")
def test_giving_memory_back_empties_the_interpreters_free_lists() -> None:
    # CPython keeps up to 2,000 freed tuples of each size for reuse; scattered through a large
    # request's pymalloc arenas, they would keep those arenas from going back.
    gc.collect()
    before = sys.getallocatedblocks()
    rows = [(i, i + 1, i + 2) for i in range(20_000)]
    del rows
    assert sys.getallocatedblocks() - before > 1_500  # the free list holds them
    give_memory_back()
    assert sys.getallocatedblocks() - before < 500


@pytest.mark.parametrize("allocator", ["pymalloc", "malloc"])
def test_stats_name_the_python_allocator_the_daemon_runs_with(allocator: str) -> None:
    # What an operator reads to check that `PYTHONMALLOC=malloc` in the unit took effect.
    code = "from kvtier.daemon.service_stats import python_allocator; print(python_allocator())"
    env = dict(os.environ, PYTHONMALLOC=allocator)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == allocator


def test_housekeeping_keeps_a_chunk_just_emptied_and_gives_it_back_after_its_grace(
        make_store, namespace, make_pages, make_keys) -> None:
    """A delete followed by new stores must not have their memory punched out and faulted in
    again between the two: the daemon's housekeeping waits out `IDLE_CHUNK_GRACE_S`."""
    store = make_store(host_pages=8, disk_enabled=False)  # a chunk a page
    keys = make_keys(8, seed=0)
    assert store.store(namespace, keys, make_pages(8, seed=0)).ok
    assert store.delete(namespace, keys) == 8
    assert give_arena_memory_back(store) == 0, "chunks emptied just now were given back"
    assert give_arena_memory_back(store, idle_for_s=0.0) == 8
