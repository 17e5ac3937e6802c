"""Fixtures for the remote tier: real `redis-server` processes on loopback (`redis_server`,
`redis_cluster`, from `kvtier.testing.fixtures`), stores that use them.

Without `redis-server` on the PATH these tests skip, except under CI (`KVTIER_REQUIRE_REDIS=1`,
set by `.ci/run`, which installs Debian's redis-server), where they fail instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.config import (
    DEFAULT_HOST_POLICY,
    DiskConfig,
    HbmConfig,
    HostConfig,
    RemoteConfig,
    StoreConfig,
    WritePolicy,
)
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.testing import redis as harness
from kvtier.testing.fixtures import redis_cluster, redis_server

__all__ = ["redis_cluster", "redis_server"]  # fixtures offered to the remote tests

PAGE_BYTES = 4096


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
