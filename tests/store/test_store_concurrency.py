"""Many threads storing, recalling, deleting and looking up the same keys at once.

Every recalled page must hold exactly the bytes stored under its key, no thread may see an
internal error, and the store must be sound afterwards: the races between a store, its own
demotion, a delete and a promotion of the same page all end with every slot accounted for.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier

PAGE_BYTES = 4096
NAMESPACE = Namespace("race", "bfloat16", "page-first", 16, PAGE_BYTES)
KEYS = [i.to_bytes(16, "big") for i in range(300)]
OPS_PER_THREAD = 400


def content(key: bytes) -> np.ndarray:
    return np.tile(np.frombuffer(key, np.uint8), PAGE_BYTES // len(key))


@pytest.mark.parametrize("write_policy", list(WritePolicy))
def test_concurrent_verbs_on_shared_keys_keep_the_store_sound(
        tmp_path: Path, write_policy: WritePolicy, run_threads) -> None:
    disk_slot = PAGE_BYTES + 4096
    config = StoreConfig(
        HostConfig(capacity_bytes=64 * PAGE_BYTES, chunk_bytes=16 * PAGE_BYTES),
        DiskConfig(path=tmp_path / "disk", capacity_bytes=256 * disk_slot,
                   chunk_bytes=64 * disk_slot),
        write_policy=write_policy, selective_min_hits=1)
    problems: list[str] = []

    def worker(store: PageStore, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(OPS_PER_THREAD):
            keys = rng.sample(KEYS, rng.randint(1, 24))
            choice = rng.random()
            if choice < 0.4:
                store.store(NAMESPACE, keys, np.stack([content(k) for k in keys]))
            elif choice < 0.75:
                out = np.zeros((len(keys), PAGE_BYTES), np.uint8)
                result = store.recall(NAMESPACE, keys, out)
                for row, (key, tier) in enumerate(zip(keys, result.tiers)):
                    if tier is not None and not np.array_equal(out[row], content(key)):
                        problems.append(f"wrong bytes for {key.hex()} from {tier}")
            elif choice < 0.9:
                store.delete(NAMESPACE, keys)
            else:
                store.lookup(NAMESPACE, keys)

    with PageStore(config) as store:
        run_threads(lambda seed: worker(store, seed), range(6), timeout_s=120)
        assert problems == []
        assert store.check() == []


def test_a_recall_naming_a_disk_page_twice_promotes_it_once(tmp_path: Path) -> None:
    disk_slot = PAGE_BYTES + 4096
    config = StoreConfig(
        HostConfig(capacity_bytes=4 * PAGE_BYTES, chunk_bytes=4 * PAGE_BYTES),
        DiskConfig(path=tmp_path / "disk", capacity_bytes=64 * disk_slot,
                   chunk_bytes=64 * disk_slot),
        write_policy=WritePolicy.WRITE_THROUGH)
    with PageStore(config) as store:
        keys = KEYS[:8]  # twice the host tier: the last four go to disk only
        assert store.store(NAMESPACE, keys, np.stack([content(k) for k in keys])).ok
        assert store.lookup(NAMESPACE, keys[4:5]).tiers[0].label == "disk"
        out = np.zeros((2, PAGE_BYTES), np.uint8)
        result = store.recall(NAMESPACE, [keys[4], keys[4]], out)
        assert result.ok and (out == content(keys[4])).all()
        assert store.check() == []


def labels(store: PageStore, namespace: Namespace, keys: list[bytes]) -> list[str | None]:
    return [t.label if t else None for t in store.lookup(namespace, keys).tiers]


def block_disk_writes(store: PageStore, monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[threading.Event, threading.Event]:
    """Make the disk tier's writes wait: returns (writing: set when one starts, go: lets it)."""
    writing, go = threading.Event(), threading.Event()
    write_pages = store.disk.write_pages

    def held_write(writes, overlap=None, before_run=None):  # noqa: ANN001, ANN202 - the tier's
        writing.set()
        assert go.wait(60)
        write_pages(writes, overlap, before_run)

    monkeypatch.setattr(store.disk, "write_pages", held_write)
    return writing, go


def one_page_host(make_store, namespace: Namespace, make_pages, make_keys, seed: int
                  ) -> tuple[PageStore, list[bytes], np.ndarray]:  # noqa: ANN001 - fixtures
    """A write-back store whose host holds one page, with page a of (a, b) stored: storing b
    demotes a."""
    store = make_store(host_pages=1, write_policy=WritePolicy.WRITE_BACK)
    keys, pages = make_keys(2, seed=seed), make_pages(2, seed=seed)
    assert store.store(namespace, keys[:1], pages[:1]).ok
    return store, keys, pages


def test_a_page_being_demoted_is_still_served_from_host(
        make_store, namespace, make_pages, make_keys, monkeypatch) -> None:
    store, (a, b), pages = one_page_host(make_store, namespace, make_pages, make_keys, seed=40)
    writing, go = block_disk_writes(store, monkeypatch)
    storer = threading.Thread(target=store.store, args=(namespace, [b], pages[1:]))
    storer.start()
    try:
        assert writing.wait(60)  # storing b demotes a: a's disk write is in flight
        assert labels(store, namespace, [a]) == ["host"]
        out = np.zeros((1, namespace.page_bytes), np.uint8)
        result = store.recall(namespace, [a], out)
        assert result.recalled == [a] and result.tiers == [Tier.HOST]
        assert np.array_equal(out[0], pages[0])
    finally:
        go.set()
        storer.join(60)
    assert labels(store, namespace, [a, b]) == ["disk", "host"]
    assert store.check(verify_bytes=True) == []


def test_a_page_evicted_while_read_keeps_its_slot_until_the_read_ends(
        make_store, namespace, make_pages, make_keys, monkeypatch) -> None:
    store, (a, b), pages = one_page_host(make_store, namespace, make_pages, make_keys, seed=41)
    writing, go_write = block_disk_writes(store, monkeypatch)
    reading, go_read = threading.Event(), threading.Event()
    copy_out = store.host.copy_out

    def held_copy_out(pairs, rows):  # noqa: ANN001, ANN202
        reading.set()
        assert go_read.wait(60)
        copy_out(pairs, rows)

    monkeypatch.setattr(store.host, "copy_out", held_copy_out)
    out = np.zeros((1, namespace.page_bytes), np.uint8)
    recalled = []
    storer = threading.Thread(target=store.store, args=(namespace, [b], pages[1:]))
    reader = threading.Thread(target=lambda: recalled.append(store.recall(namespace, [a], out)))
    storer.start()
    try:
        assert writing.wait(60)  # a is being demoted
        reader.start()
        assert reading.wait(60)  # and read from its host slot
        go_write.set()
        storer.join(60)
        # a's demotion is done but its host slot is still read: held, invisible, and b found
        # no host room (the one slot is a's), so b went straight to disk.
        assert labels(store, namespace, [a, b]) == ["disk", "disk"]
        assert store.stats().tier("host").used_bytes == namespace.page_bytes  # one slot
    finally:
        go_write.set()
        go_read.set()
        storer.join(60)
        reader.join(60)
    (result,) = recalled
    assert result.recalled == [a] and result.tiers == [Tier.HOST]
    assert np.array_equal(out[0], pages[0])
    assert store.stats().tier("host").used_bytes == 0  # the last reader freed the slot
    assert store.check(verify_bytes=True) == []


def held_host_copy(store: PageStore, name: str, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[threading.Event, threading.Event]:
    """Make the host tier's `name` ("copy_in" or "copy_out") wait: (started, go)."""
    started, go = threading.Event(), threading.Event()
    copy = getattr(store.host, name)

    def held(pairs, pages):  # noqa: ANN001, ANN202 - the tier's own signature
        started.set()
        assert go.wait(60)
        copy(pairs, pages)

    monkeypatch.setattr(store.host, name, held)
    return started, go


@pytest.mark.parametrize("copy", ["copy_in", "copy_out"])
def test_the_check_counts_the_slots_of_pages_deleted_while_copied(
        make_store, namespace, make_pages, make_keys, monkeypatch, copy) -> None:
    """A page deleted while its store (copy_in) or a recall (copy_out) is copying it leaves the
    table at once, but its slot stays held until that copy ends: the check must count it, not
    report the allocator as leaking (a `kvtier check` on a busy daemon)."""
    store = make_store(host_pages=4, disk_enabled=False)
    keys, pages = make_keys(2, seed=50), make_pages(2, seed=50)
    if copy == "copy_out":
        assert store.store(namespace, keys, pages).ok
    started, go = held_host_copy(store, copy, monkeypatch)
    out = np.zeros_like(pages)
    verb = (lambda: store.store(namespace, keys, pages)) if copy == "copy_in" else (
        lambda: store.recall(namespace, keys, out))
    worker = threading.Thread(target=verb)
    worker.start()
    try:
        assert started.wait(60)
        assert store.delete(namespace, keys) == 2
        assert labels(store, namespace, keys) == [None, None]
        assert store.stats().tier("host").used_bytes == 2 * namespace.page_bytes  # still held
        assert store.check() == []
    finally:
        go.set()
        worker.join(60)
    assert store.stats().tier("host").used_bytes == 0  # freed by the copy's owner
    assert store.check() == []
