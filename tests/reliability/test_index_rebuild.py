"""A lost or damaged disk index is rebuilt from the slot file: every intact page comes back.

Each slot carries its page's header and checksum, and `layout.json` beside the index keeps the
chunk size and the namespaces. A real `kvtier serve` stores write-through pages of two models
(different page sizes), stops; the index is damaged (one flipped byte of an LMDB meta page, or
the whole index deleted) and a new daemon serves every page, byte for byte, saying how many
pages came back.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.testing import daemon as harness

NUM_PAGES = 48


def _flip_a_meta_page_byte(disk: Path) -> None:
    data = disk / "index" / "data.mdb"
    with open(data, "r+b") as file:  # LMDB's magic in the first meta page
        file.seek(16)
        byte = file.read(1)
        file.seek(16)
        file.write(bytes([byte[0] ^ 0xFF]))


def _delete_the_index(disk: Path) -> None:
    shutil.rmtree(disk / "index")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "a flipped meta page byte": _flip_a_meta_page_byte, "the index deleted": _delete_the_index}


@pytest.mark.parametrize("damage", DAMAGE)
def test_the_index_is_rebuilt_from_the_slot_file_and_every_page_is_served(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool, damage: str) -> None:
    disk = tmp_path / "disk"
    args = ("--write-policy", "write-through")
    daemon = make_daemon(socket_dir / "k.sock", disk, *args)
    rng = np.random.default_rng(24)
    models = []
    with daemon.client() as client:
        for model_id, num_layers in (("small-pages", 2), ("large-pages", 8)):
            layout = harness.LAYOUT_KINDS["page-first"](NUM_PAGES, num_layers, 16, 4, 64,
                                                        "float16")
            pool = make_pool(layout)
            harness.fill_random(pool, rng, range(NUM_PAGES))
            keys = harness.random_keys(rng, NUM_PAGES)
            handle = pool.register(client, harness.namespace_for(layout, model_id))
            assert client.store(handle, keys, range(NUM_PAGES)).result().ok
            models.append((model_id, pool, keys, harness.snapshot(pool, range(NUM_PAGES))))
    daemon.stop_and_check()
    DAMAGE[damage](disk)

    restarted = make_daemon(socket_dir / "k.sock", disk, *args)
    assert any(f"{2 * NUM_PAGES} verified pages came back" in line
               for line in restarted.log_lines), restarted.log()
    assert "Traceback" not in restarted.log()
    with restarted.client() as client:
        for model_id, pool, keys, pages in models:
            handle = pool.register(client, harness.namespace_for(pool.layout, model_id))
            pool.pages[:] = 0
            result = client.recall(handle, keys, range(NUM_PAGES)).result()
            assert result.ok, (result.missing, result.failed)
            assert np.array_equal(harness.snapshot(pool, range(NUM_PAGES)), pages)
        harness.assert_sound(client)
    restarted.stop_and_check()
