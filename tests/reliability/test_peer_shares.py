"""One process cannot lock the node out through its global caps (issue #24, findings 3, 5, 9).

Against real `kvtier serve` processes. Before the fixes: 300 idle connections from one process
took every client slot (the next engine was refused); connections of one process filled
`store.max_namespaces` and every new model got `no_capacity`, still after they disconnected;
`open_namespace` handles ignored `max_pools_per_client` (20,000 on one connection); namespaces of
dtype "evil" or layout "../x" and a layout whose strides are all 0 were accepted; and past the
client cap a new `Client` got BrokenPipeError instead of the daemon's quota reply.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import AsyncClient, Client, DaemonReplyError
from kvtier.daemon.limits import Limits
from kvtier.ipc import messages as m
from kvtier.pools.layout import PoolLayout
from kvtier.testing import daemon as harness

# Another process: connects, says hello, prints "ok" or the refusal's code.
OTHER_ENGINE = ("import sys; from kvtier.client import AsyncClient, Client, DaemonReplyError\n"
                "try:\n    c = Client(sys.argv[1]); c.ping(); print('ok')\n"
                "except DaemonReplyError as e:\n    print(e.code)\n")


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return str(path)


def _hello(connection: harness.RawConnection) -> m._Reply:
    try:
        connection.send(verb="hello", id=1, version=m.PROTOCOL_VERSION)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at once: its reply is already here
    return connection.reply()


def _other_engine(socket_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", OTHER_ENGINE, str(socket_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or done.stderr


def test_idle_connections_of_one_process_leave_room_for_the_next_engine(daemon) -> None:
    share = Limits().max_clients_per_peer
    connections = []
    try:
        refusals = []
        for _ in range(300):  # more than daemon.max_clients (256)
            connection = harness.RawConnection(daemon.socket_path)
            reply = _hello(connection)
            if isinstance(reply, m.Error):
                refusals.append(reply)
                connection.close()
            else:
                connections.append(connection)
        assert len(connections) == share
        assert {r.code for r in refusals} == {"quota"}
        assert "daemon.max_clients_per_peer" in refusals[0].message
        assert _other_engine(daemon.socket_path) == "ok"  # another process still gets in
    finally:
        for connection in connections:
            connection.close()


def test_a_client_past_the_cap_gets_the_quota_reply(make_daemon, socket_dir: Path,
                                                    tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--config",
                         _config(tmp_path, "[daemon]\nmax_clients_per_peer = 2\n"))
    with daemon.client() as first, daemon.client() as second:
        for _ in range(20):  # the refusal often lands before the hello is sent: a broken pipe
            with pytest.raises(DaemonReplyError, match="max_clients_per_peer") as refused:
                Client(daemon.socket_path)
            assert refused.value.code == "quota"
        first.ping()
        second.ping()


def test_an_async_client_past_the_cap_gets_the_quota_reply(make_daemon, socket_dir: Path,
                                                          tmp_path: Path) -> None:
    """The same through `AsyncClient` (before: a ConnectionError or BrokenPipeError, the
    daemon's reason read and dropped)."""
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--config",
                         _config(tmp_path, "[daemon]\nmax_clients_per_peer = 2\n"))

    async def refused_codes() -> list[str]:
        codes = []
        for _ in range(20):
            try:
                client = await AsyncClient.connect(daemon.socket_path)
            except DaemonReplyError as exc:
                assert "max_clients_per_peer" in str(exc)
                codes.append(exc.code)
            else:
                await client.close()
                codes.append("admitted")
        return codes

    with daemon.client() as first, daemon.client() as second:
        assert asyncio.run(refused_codes()) == ["quota"] * 20
        first.ping()
        second.ping()


def _store_one(client: Client, pool, handle) -> bytes:  # noqa: ANN001
    key = os.urandom(16)
    harness.fill_random(pool, np.random.default_rng(), [0])
    assert client.store(handle, [key], [0]).result().ok
    return key


def test_one_process_cannot_take_every_namespace_and_a_full_table_admits_the_next(
        make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    config = _config(tmp_path, "[store]\nmax_namespaces = 8\n"
                               "[daemon]\nmax_namespaces_per_peer = 6\n")
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--config", config)
    layout = harness.make_layout("page-first", 2)
    pool = make_pool(layout)
    fillers = [daemon.client(f"filler-{i}") for i in range(3)]
    stored: list[bytes] = []
    refusals = []
    for i in range(12):  # over three connections of this one process
        filler = fillers[i % 3]
        namespace = harness.namespace_for(layout, f"filler-{i}")
        try:
            handle = pool.register(filler, namespace)
        except DaemonReplyError as exc:
            refusals.append(exc)
            continue
        stored.append(_store_one(filler, pool, handle))
    assert len(stored) == 6
    assert {e.code for e in refusals} == {"no_capacity"}
    assert "daemon.max_namespaces_per_peer" in str(refusals[0])
    for filler in fillers:
        filler.close()

    # Two more models fill the table (8); the fillers left, their pages stay.
    with daemon.client("late") as late:
        for i in range(2):
            handle = pool.register(late, harness.namespace_for(layout, f"late-{i}"))
            stored.append(_store_one(late, pool, handle))
    # Full, every namespace holding pages: a new model still gets in, at the cost of the
    # namespace used longest ago (filler-0), not a refusal.
    # (Figures from stats, not lookups: a lookup's handle registers its namespace again.)
    with daemon.client("new") as new:
        handle = pool.register(new, harness.namespace_for(layout, "new-model"))
        _store_one(new, pool, handle)
        stats = new.stats()
        assert stats["num_namespaces"] == 8
        assert sum(tier["num_pages"] for tier in stats["tiers"] if tier["tier"] == "host") == 8
        harness.assert_sound(new)
    daemon.assert_logged("evicted the 1 pages of the namespace used longest ago (filler-0)")


def test_namespace_handles_count_against_the_pool_cap(daemon) -> None:
    layout = harness.make_layout("page-first", 2)
    namespace = harness.namespace_for(layout, "handles")
    with daemon.client("handles") as client:
        for _ in range(Limits().max_pools_per_client):
            client.open_namespace(namespace)
        with pytest.raises(DaemonReplyError, match="max_pools_per_client") as refused:
            client.open_namespace(namespace)
        assert refused.value.code == "quota"
        assert len(client.stats()["clients"]) >= 1


@pytest.mark.parametrize("field, value", [("dtype", "evil"), ("layout", "../x"),
                                          ("layout", "/etc/kvtier"), ("layout", "a/../b"),
                                          ("layout", "")])
def test_a_namespace_of_unknown_dtype_or_path_like_layout_is_refused(daemon, field: str,
                                                                     value: str) -> None:
    spec = {"model_id": "m", "dtype": "float16", "layout": "page-first", "page_tokens": 16,
            "page_bytes": 65536, "tp_rank": 0, "tp_world_size": 1, field: value}
    connection = harness.RawConnection(daemon.socket_path)
    try:
        assert isinstance(_hello(connection), m.HelloReply)
        reply = connection.call(verb="open_namespace", id=2, namespace=spec)
        assert isinstance(reply, m.Error) and reply.code == "bad_request", reply
        assert field in reply.message
        spec[field] = {"dtype": "bfloat16", "layout": "page-first/hf"}[field]
        assert isinstance(connection.call(verb="open_namespace", id=3, namespace=spec),
                          m.PoolReply)
    finally:
        connection.close()


def test_a_layout_whose_strides_are_all_zero_is_refused(daemon, make_pool) -> None:
    good = harness.make_layout("page-first", 4)
    pool = make_pool(good, named=True)  # registered by its /dev/shm name below
    aliasing = PoolLayout(4, 4, 16, 4, 64, "float16", page_stride_bytes=0,
                          layer_stride_bytes=0, kv_stride_bytes=0)
    with daemon.client("aliasing") as client:
        with pytest.raises(DaemonReplyError, match="overlap") as refused:
            client.register_pool(harness.namespace_for(good, "aliasing"), pool.segment.name,
                                 aliasing)
        assert refused.value.code == "bad_request"
        for name in ("page_stride_bytes", "layer_stride_bytes"):
            fields = {**{f: getattr(good, f) for f in good.__dataclass_fields__}, name: 0}
            with pytest.raises(DaemonReplyError, match=name):
                client.register_pool(harness.namespace_for(good, "aliasing"), pool.segment.name,
                                     PoolLayout(**fields))
        pool.register(client, harness.namespace_for(good, "aliasing"))  # the good one works
