"""Early writeback (kvtier/tiers/writeback.py): a hint that never fails a store."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import kvtier.tiers.writeback as writeback
from kvtier.config import WritePolicy
from kvtier.tiers.writeback import start_writeback


def test_start_writeback_leaves_the_bytes_and_ignores_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "file"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * 8192, 0)
        start_writeback(fd, 0, 8192)
        start_writeback(fd, 4096, -1)  # EINVAL from the kernel: ignored
    finally:
        os.close(fd)
    start_writeback(-1, 0, 8192)  # EBADF: ignored, the caller's fdatasync reports real errors
    assert path.read_bytes() == b"x" * 8192


def test_stores_are_durable_and_verified_without_sync_file_range(
        make_store, monkeypatch, namespace, make_pages, make_keys) -> None:
    monkeypatch.setattr(writeback, "_sync_file_range", None)  # as on a system without it
    store = make_store(host_pages=2, write_policy=WritePolicy.WRITE_THROUGH)
    keys, pages = make_keys(4, seed=40), make_pages(4, seed=40)
    assert store.store(namespace, keys, pages).ok
    store.close()
    reopened = make_store(host_pages=2, write_policy=WritePolicy.WRITE_THROUGH)
    out = np.zeros_like(pages)
    assert reopened.recall(namespace, keys, out).ok and np.array_equal(out, pages)
    assert reopened.check(verify_bytes=True) == []
