"""The disk tier under restarts, corruption and full file systems.

Each fault is followed by the integrity check: the store must drop what it cannot serve and stay
sound, and pages written before the fault must still come back byte-identical.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import lmdb
import numpy as np
import pytest

import kvtier.tiers.disk as disk_module
import kvtier.tiers.disk_index as disk_index_module
from kvtier.config import WritePolicy
from kvtier.errors import StorageError
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier
from kvtier.tiers.page_format import HEADER_BYTES

from ..conftest import DISK_SLOT_BYTES

PAGE_BYTES = 4096


def tier_labels(store: PageStore, namespace: Namespace, keys: list[bytes]) -> list[str | None]:
    return [t.label if t is not None else None for t in store.lookup(namespace, keys).tiers]


def disk_slot(store: PageStore, namespace: Namespace, key: bytes) -> int:
    return store._table[namespace.fingerprint + key].disk.slot


def flip_byte(disk_dir: Path, offset: int) -> None:
    fd = os.open(disk_dir / "pages.slots", os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def host_segments() -> set[str]:
    prefix = f"kvtier-host-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def test_restart_finds_every_write_through_page_on_disk(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=3, write_policy=WritePolicy.WRITE_THROUGH)
    other = Namespace("other-model", "float16", "vllm-flash", 8, 2048, tp_rank=1, tp_world_size=2)
    keys, pages = make_keys(6, seed=1), make_pages(6, seed=1)
    other_pages = make_pages(2, seed=2, page_bytes=2048)
    assert store.store(namespace, keys, pages).ok
    assert store.store(other, keys[:2], other_pages).ok
    store.close()

    reopened = make_store(host_pages=3, write_policy=WritePolicy.WRITE_THROUGH)
    assert reopened.check() == []
    stats = reopened.stats()
    assert stats.num_namespaces == 2 and stats.tier("disk").num_pages == 8
    assert stats.tier("host").num_pages == 0
    assert tier_labels(reopened, namespace, keys) == ["disk"] * 6
    assert tier_labels(reopened, other, keys) == ["disk", "disk"] + [None] * 4
    out = np.zeros_like(pages)
    result = reopened.recall(namespace, keys, out)
    assert result.ok and result.tiers == [Tier.DISK] * 6
    assert np.array_equal(out, pages)
    out_other = np.zeros_like(other_pages)
    assert reopened.recall(other, keys[:2], out_other).ok
    assert np.array_equal(out_other, other_pages)
    assert reopened.check() == []


def test_restart_keeps_the_directory_chunk_size(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(write_policy=WritePolicy.WRITE_THROUGH, disk_chunk_bytes=8192)
    keys, pages = make_keys(3, seed=3), make_pages(3, seed=3)
    assert store.store(namespace, keys, pages).ok
    store.close()
    reopened = make_store(write_policy=WritePolicy.WRITE_THROUGH, disk_chunk_bytes=64 * 8192)
    assert reopened.disk.slots.chunk_bytes == 8192
    out = np.zeros_like(pages)
    assert reopened.recall(namespace, keys, out).ok and np.array_equal(out, pages)
    assert reopened.check() == []


def test_a_directory_of_an_older_format_is_refused_with_what_to_do(
        make_store, tmp_path, namespace, make_pages, make_keys) -> None:
    store = make_store(write_policy=WritePolicy.WRITE_THROUGH)
    assert store.store(namespace, make_keys(2, seed=30), make_pages(2, seed=30)).ok
    store.close()
    env = lmdb.open(str(tmp_path / "disk" / "index"), max_dbs=4, subdir=True)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"format", b"kvtier-disk-2")  # slots padded to 4 KiB: offsets mean other bytes
    env.close()
    with pytest.raises(StorageError, match="has format kvtier-disk-2, this kvtier reads "
                                           "kvtier-disk-4: point the disk tier at a new directory"):
        make_store(write_policy=WritePolicy.WRITE_THROUGH)


def _index_records(index_dir: Path, db_name: bytes) -> dict[bytes, bytes]:
    with lmdb.open(str(index_dir), max_dbs=4, subdir=True) as env:
        with env.begin(db=env.open_db(db_name)) as txn:
            return {bytes(key): bytes(value) for key, value in txn.cursor()}


def _as_format_3(index_dir: Path, leftover: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """Turn a format-4 index back into format 3 (records keyed scoped key, then slot, in the
    `pages` database), leaving `leftover` where a rewrite cut short would have left records.
    Returns the format-4 records it started from."""
    records = _index_records(index_dir, b"pages_by_slot")
    with lmdb.open(str(index_dir), max_dbs=4, subdir=True) as env:
        new_db, old_db = env.open_db(b"pages_by_slot"), env.open_db(b"pages")
        meta_db = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            txn.drop(new_db, delete=False)
            for key, value in leftover.items():
                txn.put(key, value, db=new_db)
            for key, value in records.items():
                txn.put(key[8:] + key[:8], value, db=old_db)
            txn.put(b"format", b"kvtier-disk-3", db=meta_db)
    return records


@pytest.mark.parametrize("cut_short", [False, True])
def test_an_index_of_format_3_is_rewritten_slot_first_and_keeps_its_pages(
        make_store, tmp_path, namespace, make_pages, make_keys, caplog, monkeypatch,
        cut_short) -> None:
    """The upgrade from format 3 keeps every page, batch after batch; a rewrite cut short
    (records already in the new database) starts over instead of keeping them."""
    monkeypatch.setattr(disk_index_module, "_UPGRADE_BATCH", 4)  # six records: two batches
    keys, pages = make_keys(6, seed=31), make_pages(6, seed=31)
    store = make_store(write_policy=WritePolicy.WRITE_THROUGH)
    assert store.store(namespace, keys, pages).ok
    store.close()
    index_dir = tmp_path / "disk" / "index"
    # What a rewrite cut short, then an older kvtier storing and deleting, can leave: the
    # record of a page deleted since, in a slot no page holds now.
    some_key, some_value = next(iter(_index_records(index_dir, b"pages_by_slot").items()))
    free_slot = 10 * DISK_SLOT_BYTES  # six pages stored, sixteen slots
    _, payload_bytes, checksum, _, _ = disk_index_module._RECORD.unpack(some_value)
    stale = {free_slot.to_bytes(8, "big") + some_key[8:24] + b"\x05" * 16:
             disk_index_module._RECORD.pack(free_slot, payload_bytes, checksum, 0.0, 0)}
    records = _as_format_3(index_dir, stale if cut_short else {})

    with caplog.at_level("WARNING", logger="kvtier.tiers.disk"):
        reopened = make_store(write_policy=WritePolicy.WRITE_THROUGH)
    assert "rewritten from format kvtier-disk-3 to kvtier-disk-4 (6 records)" in caplog.text
    out = np.zeros_like(pages)
    assert reopened.recall(namespace, keys, out).ok and np.array_equal(out, pages)
    assert reopened.check() == []
    reopened.close()
    assert _index_records(index_dir, b"pages_by_slot").keys() == records.keys()
    assert _index_records(index_dir, b"pages") == {}  # the old database is gone


def test_the_rewrite_of_a_large_format_3_index_maps_room_for_both_databases(
        make_store, tmp_path, namespace, make_pages, make_keys, monkeypatch) -> None:
    """Both databases and their copies need about five times the old index: the map grows to
    that before the rewrite (a full map would have the index moved aside and rebuilt)."""
    store = make_store(write_policy=WritePolicy.WRITE_THROUGH)
    assert store.store(namespace, make_keys(2, seed=32), make_pages(2, seed=32)).ok
    store.close()
    _as_format_3(tmp_path / "disk" / "index", {})
    said_bytes = 300 << 20  # as if data.mdb held that many: 5x is past the 256 MiB floor
    monkeypatch.setattr(disk_index_module, "_file_bytes",
                        lambda path: said_bytes if path.name == "data.mdb" else 0)
    index = disk_index_module.DiskIndex(tmp_path / "disk", 16 * DISK_SLOT_BYTES,
                                        4 * DISK_SLOT_BYTES, on_damage=pytest.fail)
    try:
        assert index._env.info()["map_size"] == 5 * said_bytes
        assert len(list(index.records())) == 2
    finally:
        index.close()


def test_pages_in_slots_that_straddle_blocks_come_back_cold(
        make_store, tmp_path, namespace, make_pages, make_keys) -> None:
    # 4160-byte slots: every slot but the first starts inside a 4 KiB block, and O_DIRECT reads
    # whole blocks around a run. Recall single pages and runs, in and out of order, cold.
    store = make_store(host_pages=2, disk_pages=12, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(12, seed=31), make_pages(12, seed=31)
    assert store.store(namespace, keys, pages).ok
    assert [disk_slot(store, namespace, k) % 4096 for k in keys[:3]] == [0, 64, 128]
    store.close()
    for order in ([5], [11], [0, 1, 2], [9, 3, 7, 8], list(range(12))):
        reopened = make_store(host_pages=16, disk_pages=12,
                              write_policy=WritePolicy.WRITE_THROUGH)
        drop_page_cache(tmp_path / "disk" / "pages.slots")
        out = np.zeros((len(order), PAGE_BYTES), np.uint8)
        result = reopened.recall(namespace, [keys[i] for i in order], out)
        assert result.ok and result.tiers == [Tier.DISK] * len(order)
        assert np.array_equal(out, pages[order])
        assert reopened.check(verify_bytes=True) == []
        reopened.close()


def test_opening_a_directory_in_use_raises_storage_error(
        make_store, namespace, make_pages, make_keys) -> None:
    store = make_store(write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(2, seed=4), make_pages(2, seed=4)
    assert store.store(namespace, keys, pages).ok
    before = host_segments()
    with pytest.raises(StorageError, match=f"in use by another kvtier process "
                                           f"\\(pid {os.getpid()}\\)"):
        make_store(write_policy=WritePolicy.WRITE_THROUGH)
    assert host_segments() == before  # the failed store released its host arena
    # The live store is unharmed.
    out = np.zeros_like(pages)
    assert store.recall(namespace, keys, out).ok and np.array_equal(out, pages)
    assert store.check() == []


def test_corrupt_page_found_while_open_is_a_failed_recall_then_a_miss(
        make_store, tmp_path, namespace, make_pages, make_keys, store_each) -> None:
    store = make_store(host_pages=2, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(4, seed=5), make_pages(4, seed=5)
    store_each(store, namespace, keys, pages)
    assert tier_labels(store, namespace, keys) == ["disk", "disk", "host", "host"]
    flip_byte(tmp_path / "disk", disk_slot(store, namespace, keys[0]) + HEADER_BYTES + 1234)

    problems = store.check(verify_bytes=True)
    assert len(problems) == 1
    assert (namespace.fingerprint + keys[0]).hex() in problems[0]
    assert "checksum mismatch" in problems[0]
    assert store.check(verify_bytes=False) == []

    sentinel = make_pages(2, seed=6)
    out = sentinel.copy()
    result = store.recall(namespace, keys[:2], out)
    assert list(result.failed) == [keys[0]] and "checksum mismatch" in result.failed[keys[0]]
    assert result.recalled == [keys[1]] and result.missing == []
    assert result.tiers == [None, Tier.DISK] and not result.ok
    assert np.array_equal(out[0], sentinel[0])  # nothing corrupt reached the caller
    assert np.array_equal(out[1], pages[1])
    stats = store.stats()
    assert stats.counters.integrity_errors == 1
    assert stats.counters.pages_recalled == 1
    assert tier_labels(store, namespace, keys[:1]) == [None]
    assert store.check() == []

    # The key can be stored again, and the dropped page's slot is reused soundly.
    assert store.store(namespace, keys[:1], pages[:1]).ok
    out = np.zeros((4, PAGE_BYTES), np.uint8)
    assert store.recall(namespace, keys, out).ok
    assert np.array_equal(out, pages)
    assert store.check() == []


def test_corrupt_header_is_caught(make_store, tmp_path, namespace, make_pages,
                                  make_keys) -> None:
    store = make_store(host_pages=1, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(2, seed=7), make_pages(2, seed=7)
    assert store.store(namespace, keys, pages).ok  # keys[1] is on disk only
    flip_byte(tmp_path / "disk", disk_slot(store, namespace, keys[1]) + 40)  # inside the key
    out = np.zeros((1, PAGE_BYTES), np.uint8)
    result = store.recall(namespace, keys[1:], out)
    assert "another page" in result.failed[keys[1]]
    assert not out.any()
    assert store.check() == []


def test_corrupt_page_found_after_restart(
        make_store, tmp_path, namespace, make_pages, make_keys) -> None:
    store = make_store(host_pages=4, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(3, seed=8), make_pages(3, seed=8)
    assert store.store(namespace, keys, pages).ok
    slot = disk_slot(store, namespace, keys[1])
    store.close()
    flip_byte(tmp_path / "disk", slot + HEADER_BYTES + PAGE_BYTES - 1)  # the last payload byte

    reopened = make_store(host_pages=4, write_policy=WritePolicy.WRITE_THROUGH)
    problems = reopened.check(verify_bytes=True)
    assert len(problems) == 1 and (namespace.fingerprint + keys[1]).hex() in problems[0]
    sentinel = make_pages(3, seed=9)
    out = sentinel.copy()
    result = reopened.recall(namespace, keys, out)
    assert list(result.failed) == [keys[1]]
    assert result.recalled == [keys[0], keys[2]]
    assert np.array_equal(out[[0, 2]], pages[[0, 2]])
    assert np.array_equal(out[1], sentinel[1])
    assert reopened.stats().counters.integrity_errors == 1
    assert tier_labels(reopened, namespace, keys) == ["host", None, "host"]
    assert reopened.check() == []
    reopened.close()

    # The drop reached the index: a second restart does not see the corrupt page.
    again = make_store(host_pages=4)
    assert tier_labels(again, namespace, keys) == ["disk", None, "disk"]
    assert again.check() == []


def test_check_during_a_disk_write_finds_nothing_wrong(
        make_store, monkeypatch, namespace, make_pages, make_keys) -> None:
    # The index record is committed before the fdatasync, the table learns the checksum after:
    # a check in between (the daemon serves `check` during traffic) must not call that a problem.
    store = make_store(write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(3, seed=32), make_pages(3, seed=32)
    found: list[list[str]] = []
    real_fdatasync = os.fdatasync

    def check_then_fdatasync(fd: int) -> None:
        found.append(store.check(verify_bytes=True))
        real_fdatasync(fd)

    monkeypatch.setattr(disk_module.os, "fdatasync", check_then_fdatasync)
    assert store.store(namespace, keys, pages).ok
    assert found == [[]]
    monkeypatch.undo()
    assert store.check(verify_bytes=True) == []


def enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("call", ["posix_fallocate", "pwritev", "fdatasync"])
def test_full_disk_fails_write_through_keys_and_keeps_earlier_pages(
        make_store, monkeypatch, namespace, make_pages, make_keys, call: str) -> None:
    # One slot per chunk: every new page grows the slot file, so posix_fallocate runs each time.
    store = make_store(host_pages=8, write_policy=WritePolicy.WRITE_THROUGH,
                       disk_chunk_bytes=8192)
    keys, pages = make_keys(5, seed=10), make_pages(5, seed=10)
    assert store.store(namespace, keys[:2], pages[:2]).ok

    monkeypatch.setattr(disk_module.os, call, enospc)
    result = store.store(namespace, keys[2:4], pages[2:4])
    assert result.stored == [] and sorted(result.failed) == sorted(keys[2:4])
    assert all("full" in problem for problem in result.failed.values())
    assert tier_labels(store, namespace, keys) == ["host", "host", None, None, None]
    stats = store.stats()
    assert stats.tier("disk").num_pages == 2 and stats.tier("host").num_pages == 2
    assert stats.counters.store_failures == 2
    assert store.check() == []
    monkeypatch.undo()

    out = np.zeros((2, PAGE_BYTES), np.uint8)
    assert store.recall(namespace, keys[:2], out).ok and np.array_equal(out, pages[:2])
    assert store.store(namespace, keys[2:], pages[2:]).ok
    out = np.zeros((5, PAGE_BYTES), np.uint8)
    assert store.recall(namespace, keys, out).ok and np.array_equal(out, pages)
    assert store.stats().tier("disk").num_pages == 5
    assert store.check() == []


def test_full_disk_during_demotion_drops_the_page_and_counts_it(
        make_store, monkeypatch, namespace, make_pages, make_keys, store_each) -> None:
    store = make_store(host_pages=2, write_policy=WritePolicy.WRITE_BACK, disk_chunk_bytes=8192)
    keys, pages = make_keys(3, seed=11), make_pages(3, seed=11)
    monkeypatch.setattr(disk_module.os, "posix_fallocate", enospc)
    # write-back acknowledges host copies; the demotion of keys[0] fails later
    store_each(store, namespace, keys, pages)
    stats = store.stats()
    assert stats.counters.demotion_failures == 1 and stats.counters.demotions == 0
    assert tier_labels(store, namespace, keys) == [None, "host", "host"]
    assert stats.tier("disk").used_bytes == 0
    assert store.check() == []
    monkeypatch.undo()
    assert store.store(namespace, keys[:1], pages[:1]).ok  # demotes keys[1] for real
    assert tier_labels(store, namespace, keys) == ["host", "disk", "host"]
    out = np.zeros((3, PAGE_BYTES), np.uint8)
    assert store.recall(namespace, keys, out).ok and np.array_equal(out, pages)
    assert store.check() == []


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs mounted for this test only; skipped where mounting is not allowed."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_real_full_file_system(make_store, small_tmpfs, namespace, make_pages,
                               make_keys) -> None:
    # The disk tier's capacity (200 pages, 812 KiB) fits its file system (1 MiB) at start (a
    # larger one is refused then); another program then takes half of the file system.
    store = make_store(host_pages=4, disk_pages=200, write_policy=WritePolicy.WRITE_THROUGH,
                       disk_path=small_tmpfs / "disk", disk_chunk_bytes=8 * 8192)
    (small_tmpfs / "neighbour").write_bytes(bytes(512 << 10))
    keys, pages = make_keys(512, seed=12), make_pages(512, seed=12)
    stored: list[int] = []
    failure = None
    for index in range(512):
        result = store.store(namespace, keys[index : index + 1], pages[index : index + 1])
        if not result.ok:
            failure = result.failed[keys[index]]
            break
        stored.append(index)
    assert failure is not None and "full" in failure, failure
    assert 16 <= len(stored) < 256
    assert store.check() == []
    out = np.zeros((len(stored), PAGE_BYTES), np.uint8)
    assert store.recall(namespace, [keys[i] for i in stored], out).ok
    assert np.array_equal(out, pages[stored])
    # Freeing pages makes room again.
    assert store.delete(namespace, [keys[i] for i in stored[:8]]) == 8
    assert store.store(namespace, keys[len(stored) : len(stored) + 1],
                       pages[len(stored) : len(stored) + 1]).ok
    assert store.check() == []
    store.close()
