"""Pages of one namespace are invisible to every other, through the daemon.

Two engines may use the same 16-byte key for different KV (another model, dtype or tensor-parallel
rank): a lookup, recall or delete under one namespace must never touch the other's page.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.client import SharedPool
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout
from kvtier.testing.daemon_process import DaemonProcess

LAYOUT = PoolLayout.page_first(8, 2, 16, 2, 64, "float16")
OWNER = Namespace("model-a", "float16", "page-first", 16, LAYOUT.page_bytes)
STRANGERS = {
    "another model": Namespace("model-b", "float16", "page-first", 16, LAYOUT.page_bytes),
    "another tp rank": Namespace("model-a", "float16", "page-first", 16, LAYOUT.page_bytes,
                                 tp_rank=1, tp_world_size=2),
}
POISON = 0xEE


@pytest.mark.parametrize("stranger", STRANGERS.values(), ids=STRANGERS.keys())
def test_another_namespace_cannot_read_or_delete_a_page_under_the_same_key(
        reliability_daemon: DaemonProcess, stranger: Namespace) -> None:
    rng = np.random.default_rng()
    keys = [rng.bytes(16) for _ in range(4)]
    with reliability_daemon.client("owner") as owner, SharedPool(LAYOUT) as owner_pool, \
            reliability_daemon.client("stranger") as other, SharedPool(LAYOUT) as other_pool:
        owner_pool.pages[:4] = rng.integers(0, 256, owner_pool.pages[:4].shape, dtype=np.uint8)
        stored = owner_pool.pages[:4].copy()
        owner_handle = owner_pool.register(owner, OWNER)
        assert owner.store(owner_handle, keys, range(4)).result().ok
        other_handle = other_pool.register(other, stranger)
        other_pool.pages[:] = POISON

        assert other.lookup(other_handle, keys).tiers == [None] * 4
        recall = other.recall(other_handle, keys, range(4)).result()
        assert recall.missing == keys and recall.num_done == 0
        assert (other_pool.pages == POISON).all()
        assert other.delete(other_handle, keys) == 0

        owner_pool.pages[4:8] = POISON
        assert owner.recall(owner_handle, keys, range(4, 8)).result().ok
        assert np.array_equal(owner_pool.pages[4:8], stored)
        assert owner.check() == []
