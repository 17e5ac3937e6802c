"""Shared fixtures: a small namespace, a PageStore factory with tiny tiers, seeded random pages.

Every store a test makes through `make_store` is closed at teardown, and an autouse fixture fails
any test that leaves a host arena of this process behind in /dev/shm.

The real-daemon fixtures (`daemon`, `make_daemon`, `make_pool`, `socket_dir`) come from
`kvtier.testing.fixtures` and are offered to every test directory; test modules import the tools
behind them as `from kvtier.testing import daemon as harness`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from kvtier.config import DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.testing.fixtures import daemon, make_daemon, make_pool, pytest_sessionstart, socket_dir

# fixtures offered to every test, and the hook that starts the reaper of a killed run
__all__ = ["daemon", "make_daemon", "make_pool", "pytest_sessionstart", "socket_dir"]

PAGE_BYTES = 4096
PAGE_TOKENS = 16
HOST_SLOT_BYTES = PAGE_BYTES  # 4096 is already 64-byte aligned
DISK_SLOT_BYTES = 4160  # 64-byte header + 4096 payload (disk slots are packed at 64 bytes)


def our_host_segments() -> set[str]:
    """Names of this process's host arenas under /dev/shm."""
    prefix = f"kvtier-host-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


@pytest.fixture(autouse=True)
def no_leaked_host_segments() -> Iterator[None]:
    """Fail a test that leaves one of this process's host arenas behind."""
    before = our_host_segments()
    yield
    leaked = our_host_segments() - before
    assert not leaked, f"host arenas left in /dev/shm: {sorted(leaked)}"


@pytest.fixture
def cupy() -> ModuleType:
    """CuPy, for a test that needs a CUDA device: skipped without CuPy or without a device."""
    cupy = pytest.importorskip("cupy")
    try:
        has_device = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # CuPy without a driver raises rather than counting none
        has_device = False
    if not has_device:
        pytest.skip("no CUDA device")
    return cupy


@pytest.fixture
def namespace() -> Namespace:
    """A small namespace: 16-token, 4 KiB pages."""
    return Namespace("test-model", "bfloat16", "page-first", PAGE_TOKENS, PAGE_BYTES)


def random_pages(num_pages: int, seed: int, page_bytes: int = PAGE_BYTES) -> np.ndarray:
    """`num_pages` rows of seeded random bytes."""
    return np.random.default_rng(seed).integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)


def random_keys(num_keys: int, seed: int) -> list[bytes]:
    """`num_keys` distinct seeded random 16-byte keys."""
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(num_keys)]
    assert len(set(keys)) == num_keys
    return keys


StoreFactory = Callable[..., PageStore]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """Build PageStores with tiny tiers; every one made is closed at teardown.

    Keyword args: host_pages, disk_pages, write_policy, host_policy, disk_policy,
    selective_min_hits, disk_path, disk_chunk_bytes, disk_enabled, clock.
    """
    stores: list[PageStore] = []

    def factory(host_pages: int = 4, disk_pages: int = 16,
                write_policy: WritePolicy = WritePolicy.WRITE_BACK,
                host_policy: str = "lru", disk_policy: str = "lru",
                selective_min_hits: int = 2, disk_path: Path | None = None,
                disk_chunk_bytes: int = 4 * DISK_SLOT_BYTES, disk_enabled: bool = True,
                clock: Callable[[], float] | None = None) -> PageStore:
        config = StoreConfig(
            host=HostConfig(capacity_bytes=host_pages * HOST_SLOT_BYTES,
                            chunk_bytes=HOST_SLOT_BYTES, policy=host_policy, prefault=True),
            disk=DiskConfig(path=disk_path or tmp_path / "disk",
                            capacity_bytes=disk_pages * DISK_SLOT_BYTES,
                            chunk_bytes=disk_chunk_bytes, policy=disk_policy,
                            enabled=disk_enabled),
            write_policy=write_policy,
            selective_min_hits=selective_min_hits,
        )
        store = PageStore(config) if clock is None else PageStore(config, clock=clock)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


@pytest.fixture
def make_pages() -> Callable[..., np.ndarray]:
    """`make_pages(num_pages, seed, page_bytes=4096)`: seeded random page rows."""
    return random_pages


@pytest.fixture
def make_keys() -> Callable[[int, int], list[bytes]]:
    """`make_keys(num_keys, seed)`: distinct seeded random 16-byte keys."""
    return random_keys


def store_each_page(store: PageStore, namespace: Namespace, keys: list[bytes],
                    pages: np.ndarray) -> None:
    """Store each page in a call of its own: separate uses, which LRU evicts oldest first (the
    pages of one call, one prefix, leave deepest first)."""
    for key, page in zip(keys, pages, strict=True):
        assert store.store(namespace, [key], page[None]).ok


@pytest.fixture
def store_each() -> Callable[[PageStore, Namespace, list[bytes], np.ndarray], None]:
    """`store_each(store, namespace, keys, pages)`: one store call per page."""
    return store_each_page


def run_on_threads(worker: Callable[[object], None], arguments: Iterable[object],
                   timeout_s: float = 60.0) -> None:
    """Run `worker(argument)` on a thread of its own for each argument, all at once. Raises the
    first exception a worker raised; fails if a worker is still running after `timeout_s`."""
    errors: list[BaseException] = []

    def guarded(argument: object) -> None:
        try:
            worker(argument)
        except BaseException as exc:  # raised again on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(argument,), daemon=True)
               for argument in arguments]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    running = sum(thread.is_alive() for thread in threads)
    assert not running, f"{running} of {len(threads)} workers still running after {timeout_s} s"


@pytest.fixture
def run_threads() -> Callable[..., None]:
    """`run_threads(worker, arguments, timeout_s=60)`: one thread per argument, all at once;
    a worker's exception fails the test, as does a worker still running at the timeout."""
    return run_on_threads
