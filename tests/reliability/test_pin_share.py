"""A greedy client cannot pin the node's cache: a lease past `daemon.max_pinned_share` of a tier
is refused with a `quota` reply naming the setting, and a victim's pages keep their room.

The test daemon's host tier is 64 MiB of 64 KiB pages (1,024 pages); the share is set to 25%:
256 pages per client.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.client import DaemonReplyError
from kvtier.testing import daemon as harness


def test_a_lease_past_the_pinned_share_is_refused_and_the_victim_keeps_its_pages(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_DAEMON_MAX_PINNED_SHARE", "25%")
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", disk_capacity="64MiB")
    rng = np.random.default_rng(7)
    greedy_layout = harness.make_layout("page-first", 512)
    greedy_pool = make_pool(greedy_layout)
    with daemon.client("greedy") as greedy, daemon.client("victim") as victim:
        greedy_handle = greedy_pool.register(greedy, harness.namespace_for(greedy_layout, "g"))
        greedy_keys = harness.random_keys(rng, 512)
        assert greedy.store(greedy_handle, greedy_keys, list(range(512))).result().ok

        with pytest.raises(DaemonReplyError, match=r"daemon\.max_pinned_share") as refused:
            greedy.pin(greedy_handle, greedy_keys, 600.0)  # 32 MiB: half the host tier
        assert refused.value.code == "quota"
        lease, missing = greedy.pin(greedy_handle, greedy_keys[:256], 600.0)  # its whole share
        assert missing == []
        with pytest.raises(DaemonReplyError, match="max_pinned_share"):
            greedy.pin(greedy_handle, greedy_keys[256:300], 600.0)  # a second lease counts too

        # The victim stores 700 pages (44 MiB): only the greedy client's unpinned pages leave.
        victim_layout = harness.make_layout("page-first", 700)
        victim_pool = make_pool(victim_layout)
        victim_handle = victim_pool.register(victim, harness.namespace_for(victim_layout, "v"))
        victim_keys = harness.random_keys(rng, 700)
        victim_pool.pages[:] = rng.integers(0, 256, victim_pool.pages.shape, np.uint8)
        stored = victim_pool.pages.copy()
        assert victim.store(victim_handle, victim_keys, list(range(700))).result().ok
        victim_pool.pages[:] = 0
        recalled = victim.recall(victim_handle, victim_keys, list(range(700))).result()
        assert recalled.ok and np.array_equal(victim_pool.pages, stored)
        greedy.unpin(lease)
        harness.assert_sound(victim)
