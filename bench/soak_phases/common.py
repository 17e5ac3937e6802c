"""What every soak phase shares: the page layout and namespace, page contents as a function of
the key, a client that stores and verifies pages (`Pager`), a daemon stopped however a phase ends
(`running_daemon`), the shared-memory files a phase counts (`shm_files`).

Page contents are a PCG64 stream seeded by the key, so every recall is checked byte for byte
against what was stored under that key, not only by checksum.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvtier.client import Client, PoolHandle, SharedPool
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout
from kvtier.testing.daemon import poll_until
from kvtier.testing.daemon_process import DaemonProcess

# 16 tokens x 2 heads x 64 dims x 2 bytes = 4 KiB per K or V segment; x 2 layers x 2 = 16 KiB.
LAYOUT = PoolLayout.page_first(64, 2, 16, 2, 64, "float16")
PAGE_BYTES = LAYOUT.page_bytes
NAMESPACE = Namespace("soak", "float16", "page-first", 16, PAGE_BYTES)
DISK_SLOT_BYTES = 20 << 10  # a 16 KiB page plus its 64-byte header, in 4 KiB blocks
# What the daemon may hold beyond its host capacity: the interpreter and libraries (~80 MiB
# measured), one 8 MiB disk staging buffer per copy thread and the writer (40 MiB), the client
# pools it maps (16 x 1 MiB in the load phase) and allocator slack.
RSS_OVERHEAD_BYTES = 192 << 20
MUST_BE_ZERO = ("wrong_pages", "lost_pages", "corrupt_served", "leaked_segments", "leaked_fds",
                "daemon_restarts_needed")
Figures = dict[str, object]


def progress(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def key_of(*parts: object) -> bytes:
    """A 16-byte key naming one page of the soak."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def page_content(key: bytes) -> np.ndarray:
    """The bytes every page stored under `key` holds: a PCG64 stream seeded by the key."""
    generator = np.random.Generator(np.random.PCG64(int.from_bytes(key, "little")))
    return np.frombuffer(generator.bytes(PAGE_BYTES), np.uint8)


def chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def serve_args(disk_path: Path, host: str, disk: str, *extra: str) -> tuple[str, ...]:
    return ("--host-capacity", host, "--disk-path", str(disk_path), "--disk-capacity", disk,
            "--no-prefault", *extra)


class Pager:
    """A client with a 64-page pool: stores pages of keys, recalls and verifies them."""

    def __init__(self, socket_path: Path, name: str, namespace: Namespace = NAMESPACE,
                 layout: PoolLayout = LAYOUT) -> None:
        self.client = Client(socket_path, client_name=name)
        self.pool = SharedPool(layout)
        self.handle: PoolHandle = self.pool.register(self.client, namespace)
        self.num_pages = layout.num_pages

    def store(self, keys: Sequence[bytes]) -> dict[bytes, str]:
        """Store `keys` (at most one pool's worth); returns the failed ones with their reasons."""
        for page_id, key in enumerate(keys):
            self.pool.pages[page_id] = page_content(key).reshape(self.pool.pages.shape[1:])
        return self.client.store(self.handle, keys, range(len(keys))).result().failed

    def recall(self, keys: Sequence[bytes]) -> tuple[set[bytes], int, dict[bytes, str]]:
        """Recall `keys` in pool-sized batches: (keys served, how many differed, failed keys)."""
        served: set[bytes] = set()
        failed: dict[bytes, str] = {}
        num_wrong = 0
        for batch in chunks(list(keys), self.num_pages):
            self.pool.pages[: len(batch)] = 0xEE  # poison: a page reported served must be written
            result = self.client.recall(self.handle, batch, range(len(batch))).result()
            failed.update(result.failed)
            absent = set(result.missing) | set(result.failed)
            for page_id, key in enumerate(batch):
                if key in absent:
                    continue
                served.add(key)
                num_wrong += not np.array_equal(self.pool.pages[page_id].reshape(-1),
                                                page_content(key))
        return served, num_wrong, failed

    def lookup_missing(self, keys: Sequence[bytes]) -> set[bytes]:
        missing: set[bytes] = set()
        for batch in chunks(list(keys), 4096):
            tiers = self.client.lookup(self.handle, batch).tiers
            missing.update(k for k, tier in zip(batch, tiers) if tier is None)
        return missing

    def close(self) -> None:
        self.client.close()
        self.pool.close()


@contextmanager
def running_daemon(socket_path: Path, *args: str) -> Iterator[DaemonProcess]:
    """A daemon that is stopped (or killed, if it will not stop) however the block ends."""
    daemon = DaemonProcess.start(socket_path, *args)
    try:
        yield daemon
    finally:
        if daemon.running:
            try:
                daemon.stop(30)
            finally:
                if daemon.running:
                    daemon.kill()


def shm_files(prefix: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Repeat `predicate` (daemon round trips, /proc reads), pausing between tries, until it
    holds (True) or time runs out (False)."""
    return poll_until(predicate, timeout_s)
