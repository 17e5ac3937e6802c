"""pytest fixtures on a real daemon and real Redis servers: kvtier's suite uses them, and so can
an engine's own tests (`pytest_plugins = ["kvtier.testing.fixtures"]` in a top-level conftest.py).

Fixtures: `daemon` (one daemon per test module: 64 MiB host, 256 MiB disk), `make_daemon` (a
factory for tests that need their own; still-running ones are stopped and checked at teardown),
`make_pool` (shared-memory pools unlinked at teardown), `socket_dir` (a short directory for
sockets), `redis_server` and `redis_cluster` (fresh loopback servers, killed at teardown; skipped
without `redis-server`, failed instead under `KVTIER_REQUIRE_REDIS=1`). The hook
`pytest_sessionstart` starts `kvtier.testing.reaper`, so what a killed or timed-out run leaves
(servers, daemons, /dev/shm segments) is reaped after it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from kvtier.client import SegmentPool, SharedPool
from kvtier.pools.layout import PoolLayout
from kvtier.testing import reaper
from kvtier.testing import redis as redis_servers
from kvtier.testing.daemon import (
    DISK_CAPACITY,
    HOST_CAPACITY,
    DaemonProcess,
    running_daemon,
    short_socket_dir,
)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the reaper before any test: it unlinks this run's segments if the run is killed."""
    reaper.start()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon shared by a test module (64 MiB host, 256 MiB disk); a module that needs other
    settings overrides it with `running_daemon(disk_path, *serve_args)`."""
    with running_daemon(tmp_path_factory.mktemp("disk") / "disk") as process:
        yield process


@pytest.fixture
def make_daemon() -> Iterator[Callable[..., DaemonProcess]]:
    """`make_daemon(socket_path, disk_path, *args, host_capacity=, disk_capacity=,
    wait_ready=True, env=None)` (see `DaemonProcess.start`); still-running ones are stopped (and
    checked) at teardown."""
    started: list[DaemonProcess] = []

    def factory(socket_path: Path, disk_path: Path, *args: str,
                host_capacity: str = HOST_CAPACITY, disk_capacity: str = DISK_CAPACITY,
                wait_ready: bool = True, env: Mapping[str, str] | None = None) -> DaemonProcess:
        process = DaemonProcess.start(socket_path, disk_path, *args, host_capacity=host_capacity,
                                      disk_capacity=disk_capacity, wait_ready=wait_ready, env=env)
        started.append(process)
        return process

    yield factory
    for process in started:
        if process.running:
            try:
                process.stop_and_check()
            finally:
                if process.running:
                    process.kill()


@pytest.fixture
def make_pool() -> Iterator[Callable[..., SharedPool | SegmentPool]]:
    """`make_pool(layout, named=False)`: a SharedPool (a sealed memfd) or, `named`, a
    SegmentPool (a /dev/shm segment registered by name), closed at teardown."""
    pools: list[SharedPool | SegmentPool] = []

    def factory(layout: PoolLayout, named: bool = False) -> SharedPool | SegmentPool:
        pool = SegmentPool(layout) if named else SharedPool(layout)
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        pool.close()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for sockets, removed at teardown."""
    path = short_socket_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def need_redis() -> None:
    """Skip the calling test without `redis-server` (fail it under `KVTIER_REQUIRE_REDIS=1`)."""
    if redis_servers.REDIS_SERVER is None or redis_servers.REDIS_CLI is None:
        if redis_servers.redis_required():
            pytest.fail("redis-server is not installed (KVTIER_REQUIRE_REDIS=1): "
                        "apt-get install redis-server")
        pytest.skip("redis-server is not installed (Debian package redis-server)")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[redis_servers.RedisServer]:
    """A fresh, empty redis-server for one test, killed at teardown."""
    need_redis()
    server = redis_servers.RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[redis_servers.RedisCluster]:
    """A fresh three-master Redis Cluster on loopback, killed at teardown."""
    need_redis()
    cluster = redis_servers.RedisCluster(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
