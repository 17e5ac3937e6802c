"""The disk tier's slot file: page payloads in a preallocated flat file, read with O_DIRECT.

Layout: slot i of a chunk holds a 64-byte header (kvtier/tiers/page_format.py) then the payload,
packed at 64 bytes (DISK_ALIGNMENT), so a 64 KiB page takes 64 KiB + 64 bytes. Buffered writes
need no block alignment; cold reads use O_DIRECT over the whole 4 KiB blocks around a run.
Neighbouring slots share a block: writing one rewrites the other's bytes in that block with
the same values, which a crash cannot change short of a device that garbles a whole sector,
and that the read check would catch (a miss, never wrong bytes).

The file grows a whole chunk at a time; which slots are free is the `SlabAllocator`'s business,
which pages they hold the index's (kvtier/tiers/disk_index.py).

Verbs: `write`, `sync`, `read_pages`, `read_slot`, `slot_bytes_for`, `truncate`,
`describe_os_error`, `close`.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.tiers.page_format import HEADER_BYTES, pack_header, payload_checksum, verify_page
from kvtier.tiers.slots import SlabAllocator, align_up
from kvtier.tiers.writeback import start_writeback

# The disk tier's one logger name, whichever of its modules logs: operators filter on it.
log = logging.getLogger("kvtier.tiers.disk")

# Slots (header then payload) are packed at this alignment, not padded to a 4 KiB block: a
# 64 KiB page takes 64 KiB + 64 bytes, not 68 KiB (6% fewer bytes to copy, write and read).
DISK_ALIGNMENT = 64
# O_DIRECT needs offsets and lengths aligned to the logical block size: reads cover whole blocks.
DIRECT_IO_ALIGNMENT = 4096
# Adjacent slots are read and written as one system call, up to this many bytes.
MAX_RUN_BYTES = 8 << 20
# Writes go in smaller runs so the device writes one run while the next is copied.
WRITE_RUN_BYTES = 1 << 20
# pwritev takes at most IOV_MAX (1024) buffers; a slot uses up to three (header, payload, padding).
MAX_RUN_SLOTS = 300
SLOT_FILE_NAME = "pages.slots"
_ZEROS = memoryview(bytes(DISK_ALIGNMENT))  # padding after a payload is shorter than this


@dataclass(slots=True)
class DiskWrite:
    """A page to write: its slot, its payload and the payload's checksum."""

    scoped_key: bytes
    slot: int
    payload: np.ndarray | None  # None only in metadata-only mode (DiskLedger)
    checksum: int | None  # computed by `write_pages` when None


@dataclass(slots=True)
class DiskRead:
    """A page to read into `out`, verified against the index's length and checksum."""

    scoped_key: bytes
    slot: int
    payload_bytes: int
    checksum: int
    out: np.ndarray


class SlotFile:
    """The slot file of one disk tier directory.

    Args:
        path: the slot file; created if missing.
        slots: the allocator whose slot offsets this file holds.
    """

    def __init__(self, path: Path, slots: SlabAllocator) -> None:
        self.path = path
        self.slots = slots
        self._slot_bytes_by_payload: dict[int, int] = {}  # asked for every page
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._direct_fd = self._open_direct(path)
        self._allocated_bytes = os.fstat(self._fd).st_size
        self._grow_lock = threading.Lock()
        self._staging = threading.local()

    @staticmethod
    def _open_direct(slot_path: Path) -> int | None:
        try:
            return os.open(slot_path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            log.info("%s does not support O_DIRECT; cold reads go through the page cache",
                     slot_path.parent)
            return None

    @property
    def fd(self) -> int:
        """The slot file's (buffered) descriptor, for a scan of its pages."""
        return self._fd

    @property
    def allocated_bytes(self) -> int:
        """Bytes the slot file holds on its file system (it grows a chunk at a time)."""
        return self._allocated_bytes

    def slot_bytes_for(self, payload_bytes: int) -> int:
        """Size of the slot holding a page of `payload_bytes` with its header."""
        slot_bytes = self._slot_bytes_by_payload.get(payload_bytes)
        if slot_bytes is None:
            slot_bytes = self.slots.slot_bytes_for(HEADER_BYTES + payload_bytes)
            self._slot_bytes_by_payload[payload_bytes] = slot_bytes
        return slot_bytes

    def write(self, writes: Sequence[DiskWrite],
              before_run: Callable[[list[DiskWrite]], None] | None = None) -> None:
        """Copy `writes` (at least one) into the page cache, run by run, starting each run's
        writeback at once; `sync` makes them durable. Missing checksums are computed (and set).
        `before_run(run)` is called with each run's writes just before they are hashed and
        written (a store fills their payloads then, see `DiskTier.write_pages`).

        Raises:
            OSError: the file system is full or failed.
        """
        ordered = sorted(writes, key=_slot_of)
        last = ordered[-1]
        self._ensure_allocated(last.slot + self.slot_bytes_for(payload_of(last).nbytes))
        for run in _runs(ordered, self._slot_bytes_of_write, WRITE_RUN_BYTES):
            if before_run is not None:
                before_run(run)
            self._write_run(run)

    def sync(self) -> None:
        """Make every write so far durable (an fdatasync of the slot file)."""
        os.fdatasync(self._fd)

    def _slot_bytes_of_write(self, write: DiskWrite) -> int:
        return self.slot_bytes_for(payload_of(write).nbytes)

    def _write_run(self, run: list[DiskWrite]) -> None:
        # One pass per page (hash, header, buffers): this loop is the per-page cost of a store.
        slot_bytes_of = self._slot_bytes_by_payload  # filled by `_runs`' sizing of each write
        buffers: list[Any] = []  # headers, payloads, padding
        run_bytes = 0
        for write in run:
            payload = payload_of(write)
            payload_bytes = payload.nbytes
            if write.checksum is None:
                write.checksum = payload_checksum(payload)
            buffers.append(pack_header(write.scoped_key, payload_bytes, write.checksum))
            buffers.append(payload)
            slot_bytes = slot_bytes_of[payload_bytes]
            padding = slot_bytes - HEADER_BYTES - payload_bytes
            if padding:
                buffers.append(_ZEROS[:padding])
            run_bytes += slot_bytes
        offset = run[0].slot
        written = os.pwritev(self._fd, buffers, offset)
        if written != run_bytes:
            raise OSError(errno.EIO, f"short write ({written} of {run_bytes} bytes)")
        start_writeback(self._fd, offset, run_bytes)

    def _ensure_allocated(self, end_offset: int) -> None:
        # Grow the file a whole chunk at a time with real blocks (not a sparse file), so a full
        # file system fails here, before any payload is written, with a clear error.
        if end_offset <= self._allocated_bytes:
            return
        with self._grow_lock:
            target = align_up(end_offset, self.slots.chunk_bytes)
            if target > self._allocated_bytes:
                os.posix_fallocate(self._fd, self._allocated_bytes,
                                   target - self._allocated_bytes)
                self._allocated_bytes = target

    def read_pages(self, reads: Sequence[DiskRead]) -> dict[bytes, str]:
        """Read and verify `reads` into their `out` arrays.

        Only verified payloads are copied into `out`. Returns {scoped_key: problem} for pages that
        failed (I/O error or verification); empty when every page was read.
        """
        failures: dict[bytes, str] = {}
        for run in _runs(sorted(reads, key=_slot_of),
                         lambda r: self.slot_bytes_for(r.payload_bytes)):
            # Slots are not block-aligned: read the whole blocks around the run (O_DIRECT).
            last = run[-1]
            read_start = run[0].slot - run[0].slot % DIRECT_IO_ALIGNMENT
            read_end = align_up(last.slot + self.slot_bytes_for(last.payload_bytes),
                                DIRECT_IO_ALIGNMENT)
            staging = self._staging_buffer(read_end - read_start)
            try:
                got = self._read_into(staging, read_start)
            except OSError as exc:
                reason = self.describe_os_error("read", exc)
                failures.update((r.scoped_key, reason) for r in run)
                continue
            offset = run[0].slot - read_start
            for read in run:
                slot_bytes = self.slot_bytes_for(read.payload_bytes)
                view = memoryview(staging)[offset : min(offset + slot_bytes, got)]
                problem = verify_page(view, read.scoped_key, read.payload_bytes, read.checksum)
                if problem is None:
                    np.copyto(read.out, np.frombuffer(view, np.uint8, read.payload_bytes,
                                                      HEADER_BYTES))
                else:
                    failures[read.scoped_key] = problem
                offset += slot_bytes
        return failures

    def _read_into(self, staging: memoryview, offset: int) -> int:
        fd = self._direct_fd if self._direct_fd is not None else self._fd
        return os.preadv(fd, [staging], offset)

    def _staging_buffer(self, num_bytes: int) -> memoryview:
        # One page-aligned buffer per thread, kept warm: O_DIRECT needs alignment, and a fresh
        # mapping per read would pay first-touch faults every time.
        buffer: mmap.mmap | None = getattr(self._staging, "buffer", None)
        if buffer is None or len(buffer) < num_bytes:
            buffer = mmap.mmap(-1, max(num_bytes, MAX_RUN_BYTES))
            self._staging.buffer = buffer
        return memoryview(buffer)[:num_bytes]

    def read_slot(self, slot: int, payload_bytes: int) -> bytes:
        """The raw bytes of one slot (header and payload), for integrity walks and tests."""
        return os.pread(self._fd, self.slot_bytes_for(payload_bytes), slot)

    def truncate(self) -> None:
        """Forget every page: the file shrinks to nothing (the index holds none of them)."""
        os.ftruncate(self._fd, 0)
        self._allocated_bytes = 0

    def describe_os_error(self, action: str, exc: OSError) -> str:
        """A sentence for a failed `action` ("write", "read") a user can act on."""
        directory = self.path.parent
        if exc.errno == errno.ENOSPC:
            return f"disk tier file system is full ({directory}): cannot {action} pages"
        return f"disk tier {action} failed in {directory}: {exc.strerror or exc}"

    @property
    def closed(self) -> bool:
        """Whether `close` ran."""
        return self._fd < 0

    def close(self) -> None:
        """Close the slot file (idempotent)."""
        if self._fd < 0:
            return
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._fd = -1


def payload_of(write: DiskWrite) -> np.ndarray:
    """The payload of a write that carries bytes."""
    assert write.payload is not None  # only a DiskLedger takes writes without bytes
    return write.payload


def _slot_of(item: DiskWrite | DiskRead) -> int:
    return item.slot


def _runs(items: list, slot_bytes_of: Callable[[Any], int],
          max_run_bytes: int = MAX_RUN_BYTES) -> Iterator[list]:
    """Group items sorted by slot into runs of adjacent slots, bounded in bytes and count."""
    run: list = []
    run_end = run_bytes = 0
    for item in items:
        slot_bytes = slot_bytes_of(item)
        if run and (item.slot != run_end or run_bytes + slot_bytes > max_run_bytes
                    or len(run) >= MAX_RUN_SLOTS):
            yield run
            run, run_bytes = [], 0
        run.append(item)
        run_end = item.slot + slot_bytes
        run_bytes += slot_bytes
    if run:
        yield run
