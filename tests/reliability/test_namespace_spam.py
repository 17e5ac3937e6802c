"""Namespace spam cannot break the node, now or across restarts (issue #19, item 3).

Against real `kvtier serve` processes: model ids are bounded, a connection registers at most
`daemon.max_namespaces_per_client` namespaces, the store knows at most `store.max_namespaces`
(forgetting those that hold no pages first, then the pages of the coldest unpinned one), and an
index whose map filled up (MDB_MAP_FULL) serves again after a restart.
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import msgspec
import numpy as np
import pytest

from kvtier.client import DaemonReplyError
from kvtier.keys import Namespace
from kvtier.testing import daemon as harness


def _config(tmp_path: Path, **settings: dict[str, int]) -> str:
    path = tmp_path / "kvtier.toml"
    path.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())
                            for section, values in settings.items()))
    return str(path)


def _store_one(client, pool, handle) -> bytes:  # noqa: ANN001
    key = os.urandom(16)
    harness.fill_random(pool, np.random.default_rng(), [0])
    result = client.store(handle, [key], [0]).result()
    assert result.ok, result
    return key


def test_a_model_id_longer_than_the_limit_is_refused(daemon, make_pool) -> None:
    layout = harness.make_layout("page-first", 2)
    pool = make_pool(layout)
    with daemon.client() as client:
        with pytest.raises(DaemonReplyError, match="store.max_model_id_bytes") as refused:
            pool.register(client, harness.namespace_for(layout, "m" * 100_000))
        assert refused.value.code == "bad_request"
        handle = pool.register(client, harness.namespace_for(layout, "m" * 512))
        _store_one(client, pool, handle)
        harness.assert_sound(client)


def test_a_connection_registers_at_most_its_share_of_namespaces(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--config",
                         _config(tmp_path, daemon={"max_namespaces_per_client": 4}))
    layout = harness.make_layout("page-first", 2)
    pool = make_pool(layout)
    with daemon.client() as spammer:
        handles = [pool.register(spammer, harness.namespace_for(layout, f"spam-{i}"))
                   for i in range(4)]
        pool.register(spammer, harness.namespace_for(layout, "spam-0"))  # one it has: fine
        for handle in handles:
            spammer.unregister_pool(handle)  # letting go does not make room
        with pytest.raises(DaemonReplyError, match="daemon.max_namespaces_per_client") as refused:
            pool.register(spammer, harness.namespace_for(layout, "spam-4"))
        assert refused.value.code == "no_capacity"
        with daemon.client() as neighbour:
            handle = pool.register(neighbour, harness.namespace_for(layout, "neighbour"))
            _store_one(neighbour, pool, handle)
            harness.assert_sound(neighbour)


def test_the_store_forgets_empty_namespaces_first_then_the_coldest_unpinned(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    config = _config(tmp_path, store={"max_namespaces": 4})
    disk = tmp_path / "disk"
    daemon = make_daemon(socket_dir / "k.sock", disk, "--config", config, "--write-policy",
                         "write-through")
    layout = harness.make_layout("page-first", 2)
    pool = make_pool(layout)
    with daemon.client() as client:
        used = [pool.register(client, harness.namespace_for(layout, f"used-{i}"))
                for i in range(2)]
        kept = {handle: _store_one(client, pool, handle) for handle in used}
        for i in range(2):
            pool.register(client, harness.namespace_for(layout, f"empty-{i}"))
        # Full: the two empty namespaces are forgotten to make room for this one.
        fresh = pool.register(client, harness.namespace_for(layout, "fresh"))
        kept[fresh] = _store_one(client, pool, fresh)
        late = pool.register(client, harness.namespace_for(layout, "late"))
        kept[late] = _store_one(client, pool, late)
        # Full of namespaces holding pages: a pinned one is kept, the coldest other one gives
        # its pages up for the newcomer (issue #24, finding 3: it was refused).
        client.pin(used[0], [kept[used[0]]], ttl_s=600)
        pool.register(client, harness.namespace_for(layout, "one-more"))
        daemon.assert_logged("namespace used longest ago (used-1)")
        del kept[used[1]]
        for handle, key in kept.items():
            assert client.lookup(handle, [key]).tiers != [None]
        harness.assert_sound(client)
    daemon.stop_and_check()

    restarted = make_daemon(socket_dir / "k.sock", disk, "--config", config, "--write-policy",
                            "write-through")
    with restarted.client() as client:
        for handle, key in kept.items():
            again = pool.register(client, handle.namespace)
            assert client.lookup(again, [key]).tiers == ["disk"]
        harness.assert_sound(client)
    restarted.stop_and_check()


def test_an_index_whose_map_filled_serves_again_after_a_restart(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    """The attack of the issue, compressed: the namespaces database fills the 256 MiB map."""
    disk = tmp_path / "disk"
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    layout = harness.make_layout("page-first", 2)
    pool = make_pool(layout)
    namespace = harness.namespace_for(layout, "real-model")
    with daemon.client() as client:
        key = _store_one(client, pool, pool.register(client, namespace))
    daemon.stop_and_check()
    with lmdb.open(str(disk / "index"), map_size=256 << 20, max_dbs=4) as env:
        namespaces = env.open_db(b"namespaces")
        for model_id_bytes in (1 << 20, 1 << 16, 1 << 12, 256, 1):  # until not one more fits
            with pytest.raises(lmdb.MapFullError):
                for number in range(1 << 20):
                    spam = Namespace(f"{number}-".ljust(model_id_bytes, "x"), "float16",
                                     "page-first", 16, 65536)
                    record = {name: getattr(spam, name) for name in (
                        "model_id", "dtype", "layout", "page_tokens", "page_bytes", "tp_rank",
                        "tp_world_size")}
                    with env.begin(write=True, db=namespaces) as txn:
                        txn.put(spam.fingerprint, msgspec.msgpack.encode(record))

    restarted = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    assert "do not decode" not in restarted.log()  # forgotten for holding no pages
    with restarted.client() as client:
        handle = pool.register(client, namespace)
        assert client.lookup(handle, [key]).tiers == ["disk"]
        for number in range(8):  # new models register, and their pages index
            other = pool.register(client, harness.namespace_for(layout, f"new-model-{number}"))
            for _ in range(8):
                _store_one(client, pool, other)
        harness.assert_sound(client)
    restarted.stop_and_check()
