"""A client's shared-memory pool as the daemon copies it: a checked file descriptor, never a
mapping.

A client owns its pool segment and can shrink it at any moment (a bug, or an engine that frees
its memory while a job is in flight). Touching a mapping past the new end of the file raises
SIGBUS, which kills the daemon and every client's cache with it; a `preadv`/`pwritev` on the
descriptor returns short instead. So the daemon copies between client pools and its arena with
those system calls, and a short copy fails that client's job with an error naming the pool. No
check made before the copy could do the same: the client can truncate during the copy.

The name is opened once, without following a link, and every check is made on the opened
descriptor (a regular file on /dev/shm, owned by the client's uid, writable by nobody else, large
enough for its layout, not this daemon's arena, by inode, nor any daemon's, by name), so swapping
the name for a link or another file afterwards changes nothing.

It lives with the other pools, below the transfer backends, because the CPU lanes copy through
it; the daemon opens it when a pool is registered, and `kvtier.pools.pool_pages.PoolFilePages`
is one request's pages of it. Verbs: `PoolFile.open`, `PoolFile.copy_pages`, `PoolFile.close`.
"""

from __future__ import annotations

import enum
import os
import stat
from collections.abc import Sequence

import numpy as np

from kvtier.errors import ProtocolError, StorageError, TransferError
from kvtier.pools.layout import PoolLayout
from kvtier.shm import ARENA_PREFIX, SHM_DIR

# preadv/pwritev take at most IOV_MAX (1024 on Linux) buffers per call.
_MAX_BUFFERS = 1024


class CopyWay(enum.Enum):
    """Which way `PoolFile.copy_pages` moves bytes."""

    OUT_OF_POOL = "out"  # pool pages -> a host buffer (a store)
    INTO_POOL = "in"  # a host buffer -> pool pages (a recall)


class PoolFile:
    """One client pool segment, open read-write. Make with `open`.

    Args:
        name: the segment's name under /dev/shm (for messages).
        fd: the opened descriptor (owned: `close` closes it).
        size_bytes: the file's size when it was checked.
    """

    def __init__(self, name: str, fd: int, size_bytes: int) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self._fd = fd

    @classmethod
    def open(cls, name: str, uid: int, refused_inodes: Sequence[tuple[int, int]] = ()) -> PoolFile:
        """Open /dev/shm/`name` for a client of `uid`, checking what was opened, not the name.

        `refused_inodes` are (st_dev, st_ino) of the daemon's own segments (the host arena).

        Raises:
            StorageError: the segment cannot be opened.
            ProtocolError: it is a link, not a regular file, another uid's, writable by other
                users, or one of the daemon's own segments.
        """
        if name.startswith(ARENA_PREFIX + "-"):  # another daemon's arena: its clients' pages
            raise ProtocolError(f"segment {name} is a kvtier host arena, not a pool")
        # O_NONBLOCK: a FIFO planted under the name must not block the daemon in open().
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
        try:
            fd = os.open(SHM_DIR / name, flags)
        except OSError as exc:
            if os.path.islink(SHM_DIR / name):
                raise ProtocolError(f"segment {name} is a symbolic link; register the segment "
                                    "itself") from None
            raise StorageError(f"cannot open shared-memory segment {name}: {exc}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_dev != os.stat(SHM_DIR).st_dev:
                raise ProtocolError(f"segment {name} is not a shared-memory file")
            if (info.st_dev, info.st_ino) in refused_inodes:
                raise ProtocolError(f"segment {name} is the daemon's own memory, not a pool")
            if info.st_uid != uid:
                raise ProtocolError(f"segment {name} belongs to uid {info.st_uid}, not to this "
                                    f"client (uid {uid})")
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ProtocolError(f"segment {name} is writable by other users (mode "
                                    f"{stat.S_IMODE(info.st_mode):o}); make it 0600")
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, info.st_size)

    def copy_pages(self, way: CopyWay, layout: PoolLayout, first_page: int, count: int,
                   buffer: memoryview, first_offset: int, stride_bytes: int) -> None:
        """Move pages `first_page..+count` of the pool to or from `buffer`, page i at
        `first_offset + i * stride_bytes` there, stored page-first (`[layer][K, V][segment]`).

        Raises:
            TransferError: the pool is shorter than its layout now (its client shrank it); no
                signal, whatever the client does to the file meanwhile.
        """
        for file_offset, pieces in _file_runs(layout, first_page, count, first_offset,
                                               stride_bytes):
            buffers = [buffer[start:stop] for start, stop in pieces]
            wanted = sum(stop - start for start, stop in pieces)
            if way is CopyWay.OUT_OF_POOL:
                moved = os.preadv(self._fd, buffers, file_offset)
            else:
                # A write past the end would grow the file back, not fail: look first. A client
                # that truncates after this look gets its file regrown, and no signal.
                if os.fstat(self._fd).st_size < file_offset + wanted:
                    moved = -1
                else:
                    moved = os.pwritev(self._fd, buffers, file_offset)
            if moved != wanted:
                size_bytes = os.fstat(self._fd).st_size
                raise TransferError(f"pool segment {self.name} shrank to {size_bytes} bytes "
                                    f"after it was registered; its layout needs "
                                    f"{layout.span_bytes}")

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _file_runs(layout: PoolLayout, first_page: int, count: int, first_offset: int,
               stride_bytes: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """(file offset, [(buffer start, stop), ...]) per system call: every K or V segment of the
    pages, sorted by file offset, one call per stretch of the file with no gap, buffer pieces
    merged where they continue each other. A page-first pool into adjacent slots is one call of
    one piece; a layer-first pool is one call per layer and K/V, one piece per page."""
    segment = layout.segment_bytes
    page = np.arange(first_page, first_page + count, dtype=np.int64)[:, None]
    layer_kv = np.arange(layout.num_layers * 2, dtype=np.int64)[None, :]
    in_page = (layer_kv // 2) * layout.layer_stride_bytes + (layer_kv % 2) * layout.kv_stride_bytes
    file_offsets = (layout.offset_bytes + page * layout.page_stride_bytes + in_page).ravel()
    buffer_offsets = (first_offset + (page - first_page) * stride_bytes
                      + layer_kv * segment).ravel()
    order = np.argsort(file_offsets, kind="stable")
    file_offsets, buffer_offsets = file_offsets[order].tolist(), buffer_offsets[order].tolist()
    runs: list[tuple[int, list[tuple[int, int]]]] = []
    pieces: list[tuple[int, int]] = []
    run_end = -1
    for file_offset, start in zip(file_offsets, buffer_offsets):
        if file_offset != run_end or len(pieces) == _MAX_BUFFERS:
            pieces = []
            runs.append((file_offset, pieces))
        if pieces and pieces[-1][1] == start:
            pieces[-1] = (pieces[-1][0], start + segment)
        else:
            pieces.append((start, start + segment))
        run_end = file_offset + segment
    return runs
