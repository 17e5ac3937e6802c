"""A damaged disk directory never stops a start and never serves a wrong page (issue #19, item 9).

Each case stores write-through pages with a real `kvtier serve`, stops it, damages the disk
directory the way a bad disk, a full one or a person would, and starts a new daemon on it. A bad
index is logged in one line, moved aside, and the daemon serves from one rebuilt from the slot
file (tests/reliability/test_index_rebuild.py counts the pages); `check` finds nothing wrong. Also
kept here: what already held (a power-cut image of the directory, a deleted lock.mdb, a truncated
pages.slots lose nothing they do not report).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvtier.store.pages import Tier
from kvtier.testing import daemon as harness

NUM_PAGES = 24


def _store_pages(daemon, make_pool, model_id: str = "damaged-model"):  # noqa: ANN202
    layout = harness.make_layout("page-first", NUM_PAGES)
    pool = make_pool(layout)
    rng = np.random.default_rng()
    harness.fill_random(pool, rng, range(NUM_PAGES))
    keys = harness.random_keys(rng, NUM_PAGES)
    with daemon.client() as client:
        handle = pool.register(client, harness.namespace_for(layout, model_id))
        assert client.store(handle, keys, range(NUM_PAGES)).result().ok
    return pool, keys, harness.snapshot(pool, range(NUM_PAGES))


def _serves_only_right_pages(daemon, pool, keys: list[bytes], pages: np.ndarray,
                             model_id: str = "damaged-model") -> int:
    """Recall every key into a fresh pool; return how many came back (all of them whole)."""
    out_pages = np.zeros_like(pages)
    with daemon.client() as client:
        handle = pool.register(client, harness.namespace_for(pool.layout, model_id))
        pool.pages[:] = 0
        result = client.recall(handle, keys, range(NUM_PAGES)).result()
        out_pages[:] = harness.snapshot(pool, range(NUM_PAGES))
        served = [i for i, key in enumerate(keys) if key not in result.failed
                  and key not in result.missing]
        assert np.array_equal(out_pages[served], pages[served]), "a wrong page was served"
        harness.assert_sound(client)
        # The directory still works: a new page goes to disk and comes back.
        new_key = os.urandom(16)
        harness.fill_random(pool, np.random.default_rng(), [0])
        expected = pool.pages[0].copy()
        assert client.store(handle, [new_key], [0]).result().ok
        assert client.recall(handle, [new_key], [1]).result().ok
        assert np.array_equal(pool.pages[1], expected)
        harness.assert_sound(client)
    return len(served)


def _truncate(size: int) -> Callable[[Path], None]:
    return lambda data: os.truncate(data, size)


def _zero_interior(data: Path) -> None:
    with open(data, "r+b") as file:  # past the two meta pages: the B-tree pages
        file.seek(2 * 4096)
        file.write(bytes(os.path.getsize(data) - 2 * 4096))


def _garbage(data: Path) -> None:
    data.write_bytes(np.random.default_rng(19).bytes(os.path.getsize(data)))


def _garbage_interior(data: Path) -> None:
    size = os.path.getsize(data)
    with open(data, "r+b") as file:
        file.seek(2 * 4096)
        file.write(np.random.default_rng(7).bytes(size - 2 * 4096))


JUNK_PREFIX = b"\xee" * 16


def _corrupt_leaves_met_in_recovery(data: Path) -> None:
    """Many records of an unknown namespace, then every B-tree leaf holding them zeroed: LMDB
    opens the file and its databases fine, and fails only while recovery walks the records."""
    with lmdb.open(str(data.parent), map_size=256 << 20, max_dbs=4) as env:
        pages = env.open_db(b"pages_by_slot")
        with env.begin(write=True, db=pages) as txn:
            for number in range(3000):
                # Slots past any real one: the junk fills leaves of its own.
                txn.put(((1 << 62) + number).to_bytes(8, "big") + JUNK_PREFIX + bytes(16),
                        bytes(36))
    raw = bytearray(data.read_bytes())
    page_bytes = 4096
    num_zeroed = 0
    for start in range(2 * page_bytes, len(raw), page_bytes):
        flags = int.from_bytes(raw[start + 10 : start + 12], "little")
        if flags & 0x02:  # P_LEAF: its first node's key says which records it holds
            node = start + int.from_bytes(raw[start + 16 : start + 18], "little")
            if raw[node + 16 : node + 32] == JUNK_PREFIX:  # node header, slot, key
                raw[start : start + page_bytes] = bytes(page_bytes)
                num_zeroed += 1
    assert num_zeroed > 1
    data.write_bytes(raw)


DAMAGE = {"corrupt leaves met in recovery": _corrupt_leaves_met_in_recovery,
          "truncated to 8 KiB": _truncate(8192), "truncated to 4 KiB": _truncate(4096),
          "truncated to 0": _truncate(0), "truncated by one page": None,
          "zeroed interior": _zero_interior, "random garbage": _garbage,
          "garbage interior": _garbage_interior}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_index_is_moved_aside_and_the_daemon_serves(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool, damage: str) -> None:
    disk = tmp_path / "disk"
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    pool, keys, pages = _store_pages(daemon, make_pool)
    daemon.stop_and_check()
    data = disk / "index" / "data.mdb"
    if DAMAGE[damage] is None:
        os.truncate(data, os.path.getsize(data) - 4096)
    else:
        DAMAGE[damage](data)

    restarted = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    moved = [line for line in restarted.log_lines if "moved to" in line]
    assert len(moved) == 1, restarted.log()
    assert "Traceback" not in restarted.log()
    assert list(disk.glob("index.unreadable-*")), "the bad index was not kept for a post-mortem"
    _serves_only_right_pages(restarted, pool, keys, pages)
    restarted.stop_and_check()


def test_a_power_cut_image_of_the_directory_serves_no_wrong_page(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    """The directory copied while stores run, as a power cut would leave it on disk."""
    disk = tmp_path / "disk"
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    layout = harness.make_layout("page-first", NUM_PAGES)
    pool = make_pool(layout)
    rng = np.random.default_rng()
    stored: dict[bytes, np.ndarray] = {}
    copied = threading.Event()
    with daemon.client() as client:
        handle = pool.register(client, harness.namespace_for(layout, "damaged-model"))

        def copy_mid_write() -> None:
            shutil.copytree(disk, tmp_path / "image", ignore=shutil.ignore_patterns("disk.lock"))
            copied.set()

        copier = None
        for round_number in range(40):
            harness.fill_random(pool, rng, range(NUM_PAGES))
            keys = harness.random_keys(rng, NUM_PAGES)
            job = client.store(handle, keys, range(NUM_PAGES))
            if round_number == 5:
                copier = threading.Thread(target=copy_mid_write)
                copier.start()
            assert job.result().ok
            stored.update(zip(keys, harness.snapshot(pool, range(NUM_PAGES))))
            if copied.is_set():
                break
        copier.join()
    daemon.stop_and_check()

    image = make_daemon(socket_dir / "k.sock", tmp_path / "image", "--write-policy",
                        "write-through")
    keys = list(stored)
    with image.client() as client:
        handle = pool.register(client, harness.namespace_for(layout, "damaged-model"))
        num_right = 0
        for start in range(0, len(keys), NUM_PAGES):
            batch = keys[start : start + NUM_PAGES]
            result = client.recall(handle, batch, range(len(batch))).result()
            for i, key in enumerate(batch):
                if key not in result.failed and key not in result.missing:
                    assert np.array_equal(pool.pages[i], stored[key]), "a wrong page was served"
                    num_right += 1
        assert num_right > 0
        harness.assert_sound(client)


@pytest.mark.parametrize("damage", ["lock.mdb deleted", "pages.slots truncated"])
def test_a_lost_lock_file_or_a_short_slot_file_loses_nothing_unreported(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool, damage: str) -> None:
    disk = tmp_path / "disk"
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    pool, keys, pages = _store_pages(daemon, make_pool)
    daemon.stop_and_check()
    if damage == "lock.mdb deleted":
        (disk / "index" / "lock.mdb").unlink()
    else:
        os.truncate(disk / "pages.slots", NUM_PAGES // 2 * (harness.PAGE_BYTES + 64))

    restarted = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    num_served = _serves_only_right_pages(restarted, pool, keys, pages)
    if damage == "lock.mdb deleted":
        assert num_served == NUM_PAGES
    else:
        assert 0 < num_served < NUM_PAGES  # the first half, whole; the rest reported missing
    restarted.stop_and_check()


def test_records_recovery_drops_are_not_left_for_check_to_list(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    """Index records that do not decode, name an unknown namespace, or whose key and value
    name different slots are dropped at start, by their own key: `check` then finds nothing."""
    disk = tmp_path / "disk"
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    pool, keys, pages = _store_pages(daemon, make_pool)
    daemon.stop_and_check()
    with lmdb.open(str(disk / "index"), map_size=256 << 20, max_dbs=4) as env:
        index = env.open_db(b"pages_by_slot")  # records keyed slot, then scoped key
        with env.begin(write=True, db=index) as txn:
            real_key, real_value = next(iter(txn.cursor()))
            real_key, real_value = bytes(real_key), bytes(real_value)
            fingerprint = real_key[8:24]
            txn.put((1 << 20).to_bytes(8, "big") + JUNK_PREFIX + bytes(16), bytes(36))
            txn.put((1 << 20).to_bytes(8, "big") + fingerprint + b"\x01" * 16, real_value)
            txn.put(bytes(8) + fingerprint + b"\x02" * 16, b"short value")
            txn.put(b"a key of the wrong length", real_value)

    restarted = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    assert restarted.wait_for_log("dropped 4 index records", 1.0), restarted.log()
    assert _serves_only_right_pages(restarted, pool, keys, pages) == NUM_PAGES
    restarted.stop_and_check()


def test_an_index_that_fails_while_recovery_reads_it_is_rebuilt(
        make_store, namespace, make_pages, make_keys, monkeypatch, caplog) -> None:
    """An LMDB error the file check could not foresee, met while recovery reads the records:
    the store still opens, with one line saying so, on an index rebuilt from the slot file."""
    from kvtier.config import WritePolicy
    from kvtier.tiers.disk_index import DiskIndex

    store = make_store(host_pages=2, write_policy=WritePolicy.WRITE_THROUGH)
    keys = make_keys(4, seed=3)
    pages = make_pages(4, seed=3)
    assert store.store(namespace, keys, pages).ok
    store.close()

    class FailingRecordReads:
        """The real environment, except that reading the page records fails."""

        def __init__(self, env, tier) -> None:  # noqa: ANN001
            self._env, self._tier = env, tier

        def begin(self, db=None, write: bool = False):  # noqa: ANN001, ANN202
            if db is self._tier._pages_db and not write:
                raise lmdb.CorruptedError("injected: a damaged page met while reading")
            return self._env.begin(db=db, write=write)

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(self._env, name)

    opened = DiskIndex._open_index
    num_opens = []

    def open_failing_once(tier, chunk_bytes):  # noqa: ANN001, ANN202
        env, chunk_bytes = opened(tier, chunk_bytes)
        num_opens.append(1)
        return (FailingRecordReads(env, tier) if len(num_opens) == 1 else env), chunk_bytes

    monkeypatch.setattr(DiskIndex, "_open_index", open_failing_once)
    with caplog.at_level("ERROR"):
        reopened = make_store(host_pages=2, write_policy=WritePolicy.WRITE_THROUGH)
    assert len([r for r in caplog.records if "moved to" in r.getMessage()]) == 1
    assert reopened.lookup(namespace, keys).tiers == [Tier.DISK] * 4
    out = np.zeros_like(pages)
    assert reopened.recall(namespace, keys, out).ok and np.array_equal(out, pages)
    assert reopened.check(verify_bytes=True) == []
    new_keys = make_keys(2, seed=4)
    assert reopened.store(namespace, new_keys, make_pages(2, seed=4)).ok
    assert reopened.check() == []
