"""A disk tier on a small file system: a capacity it cannot hold is refused at start, naming the
free space, and chunks fit what is there.

The file system is a real 8 MiB tmpfs where this test may mount one (root); elsewhere `statvfs`
is made to report 8 MiB free, which covers the start-up check but not the slot file's growth.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.errors import StorageError
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.tiers import disk as disk_module
from tests.conftest import random_keys, random_pages

MiB = 1 << 20
FILE_SYSTEM_BYTES = 8 * MiB


@pytest.fixture
def small_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on an 8 MiB file system: a tmpfs mount when allowed, else a faked statvfs."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FILE_SYSTEM_BYTES},mode=0700", "tmpfs",
         str(mount_point)], capture_output=True, timeout=30).returncode == 0
    if not mounted:
        real_statvfs = os.statvfs

        def small_statvfs(path: os.PathLike[str] | str) -> os.statvfs_result:
            real = real_statvfs(path)
            fields = list(real)
            fields[0] = fields[1] = 4096  # f_bsize, f_frsize
            fields[4] = FILE_SYSTEM_BYTES // 4096  # f_bavail
            return os.statvfs_result(fields)

        monkeypatch.setattr(disk_module.os, "statvfs", small_statvfs)
    yield mount_point
    if mounted:
        # Lazily: a store a failing test left open must not keep the mount for ever.
        subprocess.run(["umount", "-l", str(mount_point)], check=True, timeout=30)


def open_store(path: Path, disk_bytes: int) -> PageStore:
    return PageStore(StoreConfig(
        host=HostConfig(capacity_bytes=4 * MiB, prefault=False),
        disk=DiskConfig(path=path / "disk", capacity_bytes=disk_bytes),  # default 256 MiB chunk
        write_policy=WritePolicy.WRITE_THROUGH))


def test_a_disk_capacity_the_file_system_cannot_hold_is_refused_naming_the_free_space(
        small_file_system: Path) -> None:
    with pytest.raises(StorageError, match=r"64\.0 MiB.*file system has [78]\.\d MiB free"):
        open_store(small_file_system, 64 * MiB).close()  # closed only if it wrongly started


def test_chunks_fit_the_file_system_and_write_through_stores_succeed(
        small_file_system: Path) -> None:
    store = open_store(small_file_system, 6 * MiB)
    try:
        assert store.disk is not None and store.disk.slots.chunk_bytes <= 6 * MiB // 16
        namespace = Namespace("model", "bfloat16", "page-first", 16, 64 << 10)
        slot_file = small_file_system / "disk" / "pages.slots"
        for batch in range(8):  # 4 MiB of pages in 8 stores: the slot file grows chunk by chunk
            keys = random_keys(8, seed=batch)
            pages = random_pages(8, seed=batch, page_bytes=64 << 10)
            result = store.store(namespace, keys, pages)
            assert result.ok, result.failed
            if batch == 0:  # 8 pages of 64 KiB took a chunk or two, not the whole capacity
                assert slot_file.stat().st_size <= 1 * MiB
        out = np.zeros_like(pages)
        assert store.recall(namespace, keys, out).ok and np.array_equal(out, pages)
        assert store.check(verify_bytes=True) == []
    finally:
        store.close()
