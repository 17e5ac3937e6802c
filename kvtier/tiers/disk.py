"""The disk tier: page payloads in a preallocated slot file, the index in LMDB.

Why a slot file and not LMDB values: measured on this project's machines (256 MiB of pages, see
docs/design-notes.md), LMDB values read cold at 0.1 GB/s (mmap faults one 4 KiB page at a time)
against 1.0-1.6 GB/s for O_DIRECT reads of a flat file, and write at 0.3-0.8 GB/s against
0.5-1.5 GB/s for fsync'd file writes. The index (key -> slot, length, checksum, access data) is
small and transactional, which is what LMDB is good at.

`DiskTier` is the face the store sees: it locks the directory for one process and drives its two
halves, the slot file (kvtier/tiers/slot_file.py: layout, O_DIRECT reads) and the index
(kvtier/tiers/disk_index.py: records, namespaces, recovery, damage).

Durability: payloads are fdatasync'd before a store is acknowledged; the index commit that makes
them visible reaches the page cache at once and the disk within INDEX_SYNC_INTERVAL_S (see
disk_index.py for what a crash can lose).

Verbs: `recover`, `remember_namespace`, `forget_namespaces`, `namespaces`, `write_pages`,
`read_pages`, `remove`, `records`, `sync_index`, `read_slot`, `save_access`, `close`.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb

from kvtier.errors import StorageError
from kvtier.keys import Namespace
from kvtier.sizes import format_bytes
from kvtier.tiers.disk_index import INDEX_SYNC_INTERVAL_S, DiskIndex, DiskRecord
from kvtier.tiers.slot_file import (
    DIRECT_IO_ALIGNMENT,
    DISK_ALIGNMENT,
    MAX_RUN_BYTES,
    SLOT_FILE_NAME,
    WRITE_RUN_BYTES,
    DiskRead,
    DiskWrite,
    SlotFile,
)
from kvtier.tiers.slots import SlabAllocator

# Importers name these through the disk tier, whichever of its modules defines them.
__all__ = ["DIRECT_IO_ALIGNMENT", "DISK_ALIGNMENT", "INDEX_SYNC_INTERVAL_S", "MAX_RUN_BYTES",
           "WRITE_RUN_BYTES", "DiskRead", "DiskRecord", "DiskTier", "DiskWrite"]


class DiskTier:
    """Pages on one file system directory.

    Args:
        path: directory for the slot file and the index; created if missing.
        capacity_bytes: most bytes of slots the tier may hold (the slot file never grows beyond).
        chunk_bytes: slot file allocation unit; fixed at the directory's creation.

    Raises:
        StorageError: the directory is in use by another process or cannot be created.
    """

    def __init__(self, path: Path, capacity_bytes: int, chunk_bytes: int) -> None:
        self.path = Path(path)
        try:
            _make_private_dirs(self.path)
        except OSError as exc:
            raise StorageError(f"cannot create disk tier directory {self.path}: {exc}") from exc
        if not self.path.is_dir():
            raise StorageError(f"disk tier path {self.path} is a file, not a directory; pass a "
                               f"directory (created if missing) as --disk-path")
        self._lock_fd = self._lock_directory()
        self._disk_index = DiskIndex(self.path, capacity_bytes, chunk_bytes, self._start_over)
        self.slots = SlabAllocator(capacity_bytes, self._disk_index.chunk_bytes, DISK_ALIGNMENT)
        self._slot_file = SlotFile(self.path / SLOT_FILE_NAME, self.slots)
        self._rebuilt_in_recovery = False
        try:
            self._check_room()
            if self._disk_index.damaged_at_open:
                self._rebuild_index()
        except BaseException:
            self.close()
            raise

    def _check_room(self) -> None:
        """Refuse a capacity the file system cannot hold: stores would fail at the first chunk
        that does not fit, long after a start that looked fine."""
        stat = os.statvfs(self.path)
        free_bytes = stat.f_bavail * stat.f_frsize
        held_bytes = self._slot_file.allocated_bytes  # ours already: it counts as room
        if self.slots.capacity_bytes > free_bytes + held_bytes:
            raise StorageError(
                f"the disk tier's capacity ({format_bytes(self.slots.capacity_bytes)}) does not "
                f"fit {self.path}: its file system has {format_bytes(free_bytes)} free"
                + (f" and the slot file holds {format_bytes(held_bytes)}" if held_bytes else "")
                + f"; lower --disk-capacity (disk.capacity) to at most "
                f"{format_bytes(free_bytes + held_bytes)}, less room for the index, or free space")

    def _start_over(self, exc: BaseException) -> None:
        """The index failed while recovery read it: move it aside, start on an empty one, and
        forget the slot file's pages (none is indexed any more)."""
        self._disk_index.start_over(exc, self.slots.chunk_bytes)
        if self._disk_index.can_rebuild:
            self._rebuild_index()
            self._rebuilt_in_recovery = True
        else:
            self._slot_file.truncate()

    def _rebuild_index(self) -> None:
        """Index the slot file's verified pages again (the index was lost or damaged)."""
        self._disk_index.rebuild(self._slot_file.fd, self._slot_file.allocated_bytes,
                                 DISK_ALIGNMENT)

    def sync_index(self) -> None:
        """Make every index commit so far durable (an fsync of the index)."""
        self._disk_index.sync()

    def _lock_directory(self) -> int:
        lock_path = self.path / "disk.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StorageError(
                f"disk tier directory {self.path} is in use by another kvtier process "
                f"(pid {owner}); stop it or choose another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    @property
    def capacity_bytes(self) -> int:
        """Bytes of slots the tier may hold."""
        return self.slots.capacity_bytes

    def slot_bytes_for(self, payload_bytes: int) -> int:
        """Size of the slot holding a page of `payload_bytes` with its header."""
        return self._slot_file.slot_bytes_for(payload_bytes)

    def recover(self, page_bytes_by_fingerprint: dict[bytes, int]) -> list[DiskRecord]:
        """Rebuild slot accounting from the index and return every usable record.

        Records that do not decode, or whose namespace is unknown, or whose slot is out of range or
        collides with another, are removed from the index by their own key (logged); their pages
        are misses from now on. An index that fails while being read is moved aside (logged) and
        rebuilt from the slot file.
        """
        records = self._disk_index.recover(page_bytes_by_fingerprint, self.slots,
                                           self.slot_bytes_for)
        if self._rebuilt_in_recovery:  # damage met while reading: read the rebuilt index
            self._rebuilt_in_recovery = False
            records = self._disk_index.recover(page_bytes_by_fingerprint, self.slots,
                                               self.slot_bytes_for)
        return records

    def remember_namespace(self, namespace: Namespace) -> None:
        """Persist `namespace` so pages of it can be recovered after a restart."""
        self._disk_index.remember_namespace(namespace)

    def forget_namespaces(self, fingerprints: Sequence[bytes]) -> None:
        """Remove these namespaces' records (no page of theirs is indexed any more)."""
        self._disk_index.forget_namespaces(fingerprints)

    def namespaces(self) -> list[Namespace]:
        """Every namespace remembered in this directory. A record that does not decode is
        removed (its pages become misses: recovery drops records of unknown namespaces); an
        index that fails while being read is moved aside and rebuilt from the slot file."""
        found = self._disk_index.namespaces()
        if self._rebuilt_in_recovery:  # read the rebuilt index's namespaces (its pages later)
            found = self._disk_index.namespaces()
        return found

    def write_pages(self, writes: Sequence[DiskWrite],
                    overlap: Callable[[], None] | None = None,
                    before_run: Callable[[list[DiskWrite]], None] | None = None) -> None:
        """Write `writes` durably, then index them; run `overlap()` while the device writes.

        Checksums missing from `writes` are computed here (and set on them). Each run of
        adjacent slots is copied into the page cache and its writeback started at once, so the
        device writes run 1 while the next runs are copied; the caller's `overlap` work (the
        host copy of a write-through store) and the index commit then run while the device
        finishes, and one fdatasync ends the store. All in the caller's thread: a hand-off to a
        writer thread cost 0.1-1 ms of wake-up per store on a loaded 2-core machine. The index
        commit waits for the payload's writes but not for their fdatasync: both finish before
        this returns, and only an OS crash between them could leave index records whose slots
        fail verification (misses, never wrong bytes). `overlap` is called once unless the
        writes fail before it. `before_run(run)` is called with each run of adjacent slots'
        writes before they are hashed and written: a store copies their pages into host
        slots then and writes them from there, each run while its bytes are in the CPU's
        caches (`python bench/bench_tiers.py`: stores of 64 KiB pages 10% faster than with
        the whole host copy after the writes).

        Raises:
            StorageError: the file system is full or failed; none of `writes` is indexed.
        """
        indexed = False
        try:
            if writes:
                self._slot_file.write(writes, before_run)
            if overlap is not None:
                overlap()
            if writes:
                self._disk_index.add(writes)
                indexed = True
                self._slot_file.sync()
        except OSError as exc:
            if indexed:
                self.remove([(write.scoped_key, write.slot) for write in writes])
            raise StorageError(self._slot_file.describe_os_error("write", exc)) from exc
        except lmdb.Error as exc:
            raise StorageError(self._disk_index.describe_error(exc)) from exc

    def read_pages(self, reads: Sequence[DiskRead]) -> dict[bytes, str]:
        """Read and verify `reads` into their `out` arrays.

        Only verified payloads are copied into `out`. Returns {scoped_key: problem} for pages that
        failed (I/O error or verification); empty when every page was read.
        """
        return self._slot_file.read_pages(reads)

    def read_slot(self, slot: int, payload_bytes: int) -> bytes:
        """The raw bytes of one slot (header and payload), for integrity walks and tests."""
        return self._slot_file.read_slot(slot, payload_bytes)

    def remove(self, keys_and_slots: Sequence[tuple[bytes, int]]) -> None:
        """Delete the index records of these (scoped key, slot) pairs; the slots may then be reused.

        Records are named by key and slot, so dropping an old copy of a page never removes a
        newer copy of the same key stored meanwhile in another slot.
        """
        self._disk_index.remove(keys_and_slots)

    def records(self) -> Iterator[DiskRecord]:
        """Every record in the index, for recovery and integrity walks."""
        return self._disk_index.records()

    def save_access(self, records: Sequence[DiskRecord]) -> None:
        """Persist access data (last access, hits) of indexed pages in one transaction."""
        self._disk_index.save_access(records)

    def close(self) -> None:
        """Sync and close the index and the slot file (idempotent)."""
        if self._slot_file.closed:
            return
        self._disk_index.close()
        self._slot_file.close()
        os.close(self._lock_fd)


def _make_private_dirs(path: Path) -> None:
    """`path` and its missing parents, each created 0700 (Path.mkdir gives parents 0777 & umask)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)
