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
from kvtier.store import PageStore

PAGE_BYTES = 4096
NAMESPACE = Namespace("race", "bfloat16", "page-first", 16, PAGE_BYTES)
KEYS = [i.to_bytes(16, "big") for i in range(300)]
OPS_PER_THREAD = 400


def content(key: bytes) -> np.ndarray:
    return np.tile(np.frombuffer(key, np.uint8), PAGE_BYTES // len(key))


@pytest.mark.parametrize("write_policy", list(WritePolicy))
def test_concurrent_verbs_on_shared_keys_keep_the_store_sound(
        tmp_path: Path, write_policy: WritePolicy) -> None:
    disk_slot = PAGE_BYTES + 4096
    config = StoreConfig(
        HostConfig(capacity_bytes=64 * PAGE_BYTES, chunk_bytes=16 * PAGE_BYTES),
        DiskConfig(path=tmp_path / "disk", capacity_bytes=256 * disk_slot,
                   chunk_bytes=64 * disk_slot),
        write_policy=write_policy, selective_min_hits=1)
    problems: list[str] = []

    def worker(store: PageStore, seed: int) -> None:
        rng = random.Random(seed)
        try:
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
        except Exception as exc:  # noqa: BLE001 - reported to the test thread below
            problems.append(repr(exc))

    with PageStore(config) as store:
        threads = [threading.Thread(target=worker, args=(store, seed)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert problems == []
        assert store.check() == []


def test_a_recall_naming_a_disk_page_twice_promotes_it_once(tmp_path: Path) -> None:
    disk_slot = PAGE_BYTES + 4096
    config = StoreConfig(
        HostConfig(capacity_bytes=4 * PAGE_BYTES, chunk_bytes=4 * PAGE_BYTES),
        DiskConfig(path=tmp_path / "disk", capacity_bytes=64 * disk_slot, chunk_bytes=64 * disk_slot),
        write_policy=WritePolicy.WRITE_THROUGH)
    with PageStore(config) as store:
        keys = KEYS[:8]  # twice the host tier: the last four go to disk only
        assert store.store(NAMESPACE, keys, np.stack([content(k) for k in keys])).ok
        assert store.lookup(NAMESPACE, keys[4:5]).tiers[0].label == "disk"
        out = np.zeros((2, PAGE_BYTES), np.uint8)
        result = store.recall(NAMESPACE, [keys[4], keys[4]], out)
        assert result.ok and (out == content(keys[4])).all()
        assert store.check() == []
