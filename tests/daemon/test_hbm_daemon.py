"""The hbm tier in a real daemon (`--hbm-capacity`, host-memory stand-in without a GPU): hot pages
are promoted on their second hit, served from hbm byte-identical, and `kvtier stats` shows the
tier with its hits; the integrity check stays clean."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from kvtier.cli.main import main
from kvtier.testing import daemon as harness


def test_a_daemon_with_an_hbm_tier_promotes_hot_pages_and_shows_them(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    daemon = make_daemon(socket_dir / "hbm.sock", tmp_path / "disk", "--hbm-capacity", "1MiB")
    rng = np.random.default_rng(31)
    layout = harness.make_layout("layer-first", 32)
    pool = make_pool(layout)
    with daemon.client("hbm-test") as client:
        handle = pool.register(client, harness.namespace_for(layout, "hbm", "layer-first"))
        harness.fill_random(pool, rng, range(32))
        keys = harness.random_keys(rng, 8)
        stored = harness.snapshot(pool, range(8))
        assert client.store(handle, keys, range(8)).result().ok
        assert client.lookup(handle, keys).tiers == ["host"] * 8

        for targets in (range(8, 16), range(16, 24)):  # the second hit promotes them
            assert client.recall(handle, keys, targets).result().tiers == ["host"] * 8
        assert client.lookup(handle, keys).tiers == ["hbm"] * 8
        recalled = client.recall(handle, keys, range(24, 32)).result()
        assert recalled.ok and recalled.tiers == ["hbm"] * 8
        np.testing.assert_array_equal(harness.snapshot(pool, range(24, 32)), stored)

        stats = client.stats()
        tiers = {tier["tier"]: tier for tier in stats["tiers"]}
        assert list(tiers) == ["hbm", "host", "disk"]
        assert tiers["hbm"]["capacity_bytes"] == 1 << 20
        assert tiers["hbm"]["num_pages"] == 8 and tiers["hbm"]["hits"] == 8
        engines = stats["engines"]
        assert engines["cpu"]["d2h"]["bytes"] == 8 * harness.PAGE_BYTES  # one store
        assert engines["cpu"]["h2d"]["bytes"] == 16 * harness.PAGE_BYTES  # two host recalls
        assert engines["hbm:cpu"]["h2d"]["bytes"] == 8 * harness.PAGE_BYTES
        assert client.check(verify_bytes=True) == []

    table = CliRunner().invoke(main, ["stats", "--socket", str(daemon.socket_path)])
    assert table.exit_code == 0, table.output
    assert "hbm" in table.output and "h2d (hbm:cpu)" in table.output
    as_json = CliRunner().invoke(main, ["stats", "--socket", str(daemon.socket_path), "--json"])
    assert json.loads(as_json.stdout)["tiers"][0]["tier"] == "hbm"
