"""The host policy's bookkeeping done while a store's or a recall's bytes are copied
(`kvtier.store.filing`): pages filed still WRITING are tracked by the check, leave the policy
again when their store fails or they are deleted meanwhile, and decisions are those of
bookkeeping done at the commit."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.store import filing
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier
from tests.store.test_store_concurrency import held_host_copy, labels

NUM_PAGES = 8


@pytest.fixture
def small_waves_filed_during_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """File waves of 4 pages on (of any size) during their copy."""
    monkeypatch.setattr(filing, "MIN_PAGES", 4)
    monkeypatch.setattr(filing, "MIN_BYTES", 0)


def host_policy(store: PageStore):  # noqa: ANN201 - whichever policy the store made
    return store._parts.placement.policies[Tier.HOST]


def held_after_filing(store: PageStore, monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[threading.Event, threading.Event]:
    """Hold the next store's host copy until `go`; `filed` is set once its wave is filed."""
    filed = threading.Event()
    planner = store._parts.planner
    file_early = planner.file_early

    def noted(entries):  # noqa: ANN001, ANN202 - the planner's own signature
        file_early(entries)
        filed.set()

    monkeypatch.setattr(planner, "file_early", noted)
    _, go = held_host_copy(store, "copy_in", monkeypatch)
    return filed, go


@contextlib.contextmanager
def store_held_after_filing(store: PageStore, namespace, keys, pages,  # noqa: ANN001
                            monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """Store in a thread, held in its host copy once its wave is filed: inside the block the
    wave is filed and not copied yet; after it the store is done, its result in the list."""
    filed, go = held_after_filing(store, monkeypatch)
    results: list = []
    worker = threading.Thread(target=lambda: results.append(store.store(namespace, keys, pages)))
    worker.start()
    try:
        assert filed.wait(60)
        yield results
    finally:
        go.set()
        worker.join(60)


def test_a_wave_filed_during_its_copy_is_invisible_and_the_check_counts_it(
        make_store, namespace, make_pages, make_keys, monkeypatch,
        small_waves_filed_during_copy) -> None:
    store = make_store(host_pages=16, disk_enabled=False, host_policy="adaptive")
    keys, pages = make_keys(NUM_PAGES, seed=1), make_pages(NUM_PAGES, seed=1)
    with store_held_after_filing(store, namespace, keys, pages, monkeypatch) as results:
        policy = host_policy(store)
        assert all(namespace.fingerprint + key in policy for key in keys)  # filed, copy held
        assert labels(store, namespace, keys) == [None] * NUM_PAGES  # bytes not complete
        assert store.check() == []
    assert results[0].ok and results[0].stored == keys
    assert len(host_policy(store)) == NUM_PAGES  # filed once, not again at the commit
    out = np.zeros_like(pages)
    assert store.recall(namespace, keys, out).ok and np.array_equal(out, pages)
    assert store.check(verify_bytes=True) == []


def test_filed_pages_deleted_or_failed_during_their_copy_leave_the_policy(
        make_store, namespace, make_pages, make_keys, monkeypatch,
        small_waves_filed_during_copy) -> None:
    store = make_store(host_pages=16, disk_enabled=False, host_policy="adaptive")
    keys, pages = make_keys(NUM_PAGES, seed=2), make_pages(NUM_PAGES, seed=2)
    deleted, failing = keys[:2], keys[5:]
    movers = store._parts.movers
    copy = movers.copy

    def copy_failing_some(*args):  # noqa: ANN002, ANN202 - the movers' own signature
        failed = copy(*args)
        return {**failed, **{key: "injected copy failure" for key in failing}}

    monkeypatch.setattr(movers, "copy", copy_failing_some)
    with store_held_after_filing(store, namespace, keys, pages, monkeypatch) as results:
        assert store.delete(namespace, deleted) == 2
        assert store.check() == []  # deleted, yet filed: still counted until the commit
    stored = keys[2:5]
    assert results[0].stored == stored and sorted(results[0].failed) == sorted(failing)
    policy = host_policy(store)
    assert len(policy) == len(stored)
    assert all((namespace.fingerprint + key in policy) == (key in stored) for key in keys)
    assert labels(store, namespace, keys) == [None, None, "host", "host", "host", None, None,
                                              None]
    assert store.check(verify_bytes=True) == []


@pytest.mark.parametrize("seed", range(2))
def test_bookkeeping_during_copies_decides_as_bookkeeping_at_the_commit(
        make_store, namespace, make_pages, make_keys, monkeypatch, seed: int) -> None:
    """One thread storing and recalling chains through a full tier: the same pages stay,
    request after request, whether the waves are filed and the hits counted during the copies
    or under the lock around them."""
    keys = make_keys(60, seed=seed)
    pages = make_pages(len(keys), seed=seed)
    chains = [keys[i:i + 6] for i in range(0, len(keys), 6)]
    histories = []
    for during_copy in (False, True):
        monkeypatch.setattr(filing, "MIN_PAGES", 1 if during_copy else 10**9)
        monkeypatch.setattr(filing, "MIN_BYTES", 0)
        store = make_store(host_pages=24, disk_enabled=False, host_policy="adaptive")
        rng = random.Random(seed)
        history = []
        for _ in range(120):
            chain = rng.choice(chains)
            length = rng.randrange(1, len(chain) + 1)
            first = keys.index(chain[0])
            out = np.zeros((length, namespace.page_bytes), np.uint8)
            store.recall(namespace, chain[:length], out)
            store.store(namespace, chain[:length], pages[first:first + length])
            history.append(labels(store, namespace, keys))
        assert store.check(verify_bytes=True) == []
        histories.append(history)
    assert histories[0] == histories[1]
    assert len({tuple(labels) for labels in histories[0]}) > 50  # pages came and went
