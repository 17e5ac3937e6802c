"""Fixtures for the remote tier: real `redis-server` processes on loopback, stores that use them.

Without `redis-server` on the PATH these tests skip, except under CI (`KVTIER_REQUIRE_REDIS=1`,
set by `.ci/run`, which installs Debian's redis-server), where they fail instead.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.config import (DEFAULT_HOST_POLICY, DiskConfig, HbmConfig, HostConfig, RemoteConfig,
                           StoreConfig, WritePolicy)
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore

HARNESS_MODULE = "kvtier_redis_harness"
PAGE_BYTES = 4096


def _load_harness():
    if HARNESS_MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            HARNESS_MODULE, Path(__file__).parent / "redis_harness.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[HARNESS_MODULE] = module
        spec.loader.exec_module(module)
    return sys.modules[HARNESS_MODULE]


harness = _load_harness()


def _need_redis() -> None:
    if harness.REDIS_SERVER is None or harness.REDIS_CLI is None:
        if harness.redis_required():
            pytest.fail("redis-server is not installed (KVTIER_REQUIRE_REDIS=1): "
                        "apt-get install redis-server")
        pytest.skip("redis-server is not installed (Debian package redis-server)")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator:
    """A fresh, empty redis-server for one test, killed at teardown."""
    _need_redis()
    server = harness.RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator:
    """A fresh three-master Redis Cluster on loopback, killed at teardown."""
    _need_redis()
    cluster = harness.RedisCluster(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def remote_namespace() -> Namespace:
    """Namespace of the remote tests: 4 KiB pages."""
    return Namespace("remote-test-model", "bfloat16", "page-first", 16, PAGE_BYTES)


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., PageStore]]:
    """`make_node(name, url, **remote)`: a PageStore with its own arena and disk dir (a "node");
    its remote timeout is the harness's `ROUND_TRIP_TIMEOUT_S` unless `timeout_s` says otherwise."""
    stores: list[PageStore] = []

    def factory(name: str, url: str, host_pages: int = 64, disk_pages: int = 0,
                write_policy: WritePolicy = WritePolicy.WRITE_BACK, hbm_pages: int = 0,
                host_policy: str = DEFAULT_HOST_POLICY, **remote: object) -> PageStore:
        remote.setdefault("timeout_s", harness.ROUND_TRIP_TIMEOUT_S)
        config = StoreConfig(
            hbm=HbmConfig(capacity_bytes=hbm_pages * PAGE_BYTES, chunk_bytes=PAGE_BYTES),
            host=HostConfig(capacity_bytes=host_pages * PAGE_BYTES, chunk_bytes=PAGE_BYTES,
                            policy=host_policy),
            disk=DiskConfig(path=tmp_path / name / "disk", capacity_bytes=max(1, disk_pages) * 8192,
                            chunk_bytes=8192 * 4, enabled=disk_pages > 0),
            write_policy=write_policy,
            remote=RemoteConfig(url=url, **remote))
        store = PageStore(config)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()
