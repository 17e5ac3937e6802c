"""The disk tier: page payloads in a preallocated slot file, the index in LMDB.

Why a slot file and not LMDB values: measured on this project's machines (256 MiB of pages, see
docs/design-notes.md), LMDB values read cold at 0.1 GB/s (mmap faults one 4 KiB page at a time)
against 1.0-1.6 GB/s for O_DIRECT reads of a flat file, and write at 0.3-0.8 GB/s against
0.5-1.5 GB/s for fsync'd file writes. The index (key -> slot, length, checksum, access data) is
small and transactional, which is what LMDB is good at.

Layout: slot i of a chunk holds a 64-byte header (kvtier/tiers/page_format.py) then the payload,
packed at 64 bytes (DISK_ALIGNMENT), so a 64 KiB page takes 64 KiB + 64 bytes. Buffered writes
need no block alignment; cold reads use O_DIRECT over the whole 4 KiB blocks around a run.
Neighbouring slots share a block: writing one rewrites the other's bytes in that block with
the same values, which a crash cannot change short of a device that garbles a whole sector,
and that the read check would catch (a miss, never wrong bytes).

Durability: payloads are fdatasync'd before a store is acknowledged; the index commit that makes
them visible reaches the page cache at once and the disk within INDEX_SYNC_INTERVAL_S. A killed
daemon loses nothing; an OS crash can lose the last second of index updates (those pages become
misses). An index delete is committed before its slot may be rewritten, and every read is
verified, so no crash can make a page serve another page's bytes.

Verbs: `recover`, `remember_namespace`, `write_pages`, `read_pages`, `remove`, `sync_index`, `read_slot`,
`save_access`, `close`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import lmdb
import msgspec
import numpy as np

from kvtier.errors import KvtierError, StorageError
from kvtier.keys import Namespace
from kvtier.tiers.slots import SlabAllocator, align_up
from kvtier.tiers.index_file import index_file_problem
from kvtier.tiers.page_format import HEADER_BYTES, pack_header, payload_checksum, verify_page
from kvtier.tiers.writeback import start_writeback

log = logging.getLogger(__name__)

# Slots (header then payload) are packed at this alignment, not padded to a 4 KiB block: a
# 64 KiB page takes 64 KiB + 64 bytes, not 68 KiB (6% fewer bytes to copy, write and read).
DISK_ALIGNMENT = 64
# O_DIRECT needs offsets and lengths aligned to the logical block size: reads cover whole blocks.
DIRECT_IO_ALIGNMENT = 4096
# Adjacent slots are read and written as one system call, up to this many bytes.
MAX_RUN_BYTES = 8 << 20
# Index commits are made durable at least this often (and at close), not one fsync each.
INDEX_SYNC_INTERVAL_S = 1.0
# Writes go in smaller runs so the device writes one run while the next is copied.
WRITE_RUN_BYTES = 1 << 20
# pwritev takes at most IOV_MAX (1024) buffers; a slot uses up to three (header, payload, padding).
MAX_RUN_SLOTS = 300
MAX_RUN_BUFFERS = 1024 - 3
_ZEROS = memoryview(bytes(DISK_ALIGNMENT))  # padding after a payload is shorter than this
_RECORD = struct.Struct("<QQQdI")  # slot offset, payload bytes, checksum, last access (epoch s), hits
_FORMAT = b"kvtier-disk-3"  # 2: index records named by key and slot; 3: slots packed at 64 bytes
# Every way reading a damaged index can fail: LMDB's own errors, records that do not decode, and
# namespace records whose values a Namespace refuses.
_INDEX_ERRORS = (lmdb.Error, msgspec.MsgspecError, struct.error, ValueError, TypeError,
                 KvtierError)


class _DamagedIndex(Exception):
    """The index file failed the check made before LMDB maps it."""


@dataclass(slots=True, frozen=True)
class DiskRecord:
    """One page as the disk index knows it."""

    scoped_key: bytes
    slot: int
    payload_bytes: int
    checksum: int | None  # None only in metadata-only mode (DiskLedger)
    last_access_s: float
    hits: int


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


class _NamespaceRecord(msgspec.Struct, frozen=True):
    model_id: str
    dtype: str
    layout: str
    page_tokens: int
    page_bytes: int
    tp_rank: int
    tp_world_size: int


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
        self._lock_fd = self._lock_directory()
        # The map size is address space, not disk: about 150 bytes of index per page of >= 4 KiB.
        # Twice what the index holds: an index that filled its map (MDB_MAP_FULL) has room again
        # after a restart, to drop what recovery drops and to take new pages.
        self._map_size = max(256 << 20, capacity_bytes // 16, 2 * _file_bytes(
            self.path / "index" / "data.mdb"))
        self._env, chunk_bytes = self._open_index(min(chunk_bytes, capacity_bytes))
        self._last_index_sync_s = time.monotonic()
        self.sync_index()
        self.slots = SlabAllocator(capacity_bytes, chunk_bytes, DISK_ALIGNMENT)
        self._slot_bytes_by_payload: dict[int, int] = {}  # asked for every page
        slot_path = self.path / "pages.slots"
        self._fd = os.open(slot_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._direct_fd = self._open_direct(slot_path)
        self._allocated_bytes = os.fstat(self._fd).st_size
        self._grow_lock = threading.Lock()
        self._staging = threading.local()
        # Runs the periodic index fsync off the callers' path (stores write in their own thread).
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-writer")

    def _open_index(self, chunk_bytes: int) -> tuple[lmdb.Environment, int]:
        # Commits are not fsync'd one by one (`sync_index` does it, at most every
        # INDEX_SYNC_INTERVAL_S): a second fsync per store would halve write-through throughput.
        # Commits still reach the page cache, so a killed daemon loses nothing; an OS crash can
        # lose the last second of index updates (those pages become misses) or, rarely, the
        # index itself, which then starts over empty. Payloads are fdatasync'd before the ack.
        index_path = self.path / "index"
        for attempt in range(2):
            env = None
            try:
                problem = index_file_problem(index_path / "data.mdb")
                if problem is not None:  # LMDB would map it and die by SIGBUS, not raise
                    raise _DamagedIndex(problem)
                _make_private(index_path)
                # mode: the index names models and keys (keys tell which prompts are cached).
                env = lmdb.open(str(index_path), map_size=self._map_size, max_dbs=4,
                                subdir=True, sync=False, metasync=False, readahead=False,
                                mode=0o700)
                self._env = env
                self._pages_db = env.open_db(b"pages")
                self._namespaces_db = env.open_db(b"namespaces")
                self._meta_db = env.open_db(b"meta")
                return env, self._agree_chunk_bytes(chunk_bytes)
            except (_DamagedIndex, *_INDEX_ERRORS) as exc:
                if env is not None:
                    env.close()
                if isinstance(exc, StorageError):  # an older format: not damage, say what to do
                    raise
                if attempt:
                    raise StorageError(f"cannot open the disk tier index in {index_path}: "
                                       f"{exc}") from exc
                self._move_index_aside(exc)
                (self.path / "pages.slots").unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def _move_index_aside(self, exc: BaseException) -> None:
        """Keep a damaged index for a post-mortem, under a name no start opens again."""
        index_path = self.path / "index"
        aside = index_path.with_name(f"index.unreadable-{time.time_ns()}")
        log.error("disk tier index %s is unreadable (%s: %s); moved to %s, starting empty",
                  index_path, type(exc).__name__, exc, aside)
        index_path.rename(aside)

    def _start_over(self, exc: BaseException) -> None:
        """The index failed while recovery read it: move it aside, start on an empty one, and
        forget the slot file's pages (none is indexed any more)."""
        self._env.close()
        self._move_index_aside(exc)
        os.ftruncate(self._fd, 0)
        self._allocated_bytes = 0
        self._env, _ = self._open_index(self.slots.chunk_bytes)
        self.sync_index()

    def sync_index(self) -> None:
        """Make every index commit so far durable (an fsync of the index)."""
        self._env.sync(True)
        self._last_index_sync_s = time.monotonic()

    def _sync_index_if_due(self) -> None:
        if time.monotonic() - self._last_index_sync_s >= INDEX_SYNC_INTERVAL_S:
            self._last_index_sync_s = time.monotonic()
            self._writer.submit(self._env.sync, True)  # off the caller's path

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

    def _agree_chunk_bytes(self, wanted: int) -> int:
        # Slot offsets in the index are only meaningful with the chunk size they were made with.
        wanted -= wanted % DISK_ALIGNMENT
        with self._env.begin(write=True, db=self._meta_db) as txn:
            # A write at every start: a damaged free list shows now, inside the fallback that
            # moves the index aside, not at the first store.
            txn.put(b"opened_by", str(os.getpid()).encode())
            stored_format = txn.get(b"format")
            if stored_format is not None and stored_format != _FORMAT:
                raise StorageError(
                    f"disk tier {self.path} has format {stored_format.decode(errors='replace')}, "
                    f"this kvtier reads {_FORMAT.decode()}: point the disk tier at a new "
                    f"directory, or delete this one (its pages are lost)"
                )
            stored = txn.get(b"chunk_bytes")
            if stored is not None:
                chunk_bytes = int(stored)
                if chunk_bytes != wanted:
                    log.info("disk tier %s keeps its chunk size of %d bytes (asked %d)",
                             self.path, chunk_bytes, wanted)
                return chunk_bytes
            txn.put(b"format", _FORMAT)
            txn.put(b"chunk_bytes", str(wanted).encode())
        return wanted

    @staticmethod
    def _open_direct(slot_path: Path) -> int | None:
        try:
            return os.open(slot_path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            log.info("%s does not support O_DIRECT; cold reads go through the page cache",
                     slot_path.parent)
            return None

    @property
    def capacity_bytes(self) -> int:
        """Bytes of slots the tier may hold."""
        return self.slots.capacity_bytes

    def slot_bytes_for(self, payload_bytes: int) -> int:
        """Size of the slot holding a page of `payload_bytes` with its header."""
        slot_bytes = self._slot_bytes_by_payload.get(payload_bytes)
        if slot_bytes is None:
            slot_bytes = self.slots.slot_bytes_for(HEADER_BYTES + payload_bytes)
            self._slot_bytes_by_payload[payload_bytes] = slot_bytes
        return slot_bytes

    def recover(self, page_bytes_by_fingerprint: dict[bytes, int]) -> list[DiskRecord]:
        """Rebuild slot accounting from the index and return every usable record.

        Records that do not decode, or whose namespace is unknown, or whose slot is out of range or
        collides with another, are removed from the index by their own key (logged); their pages
        are misses from now on. An index that fails while being read is moved aside (logged) and
        the tier starts empty.
        """
        try:
            with self._env.begin(db=self._pages_db) as txn:
                raw_records = [(bytes(key), bytes(value)) for key, value in txn.cursor()]
        except _INDEX_ERRORS as exc:
            self._start_over(exc)
            return []
        records: list[DiskRecord] = []
        dropped: list[bytes] = []
        seen: set[bytes] = set()
        for record_key, value in raw_records:
            record = _decode_record(record_key, value)
            page_bytes = page_bytes_by_fingerprint.get(record_key[:16])
            # A key can have two records after a crash (a store racing its own delete); keys name
            # content, so either copy is right: keep the first.
            if (record is None or record.scoped_key in seen
                    or page_bytes != record.payload_bytes
                    or not self.slots.claim(record.slot,
                                            self.slot_bytes_for(record.payload_bytes))):
                dropped.append(record_key)
                continue
            seen.add(record.scoped_key)
            records.append(record)
        if dropped:
            log.warning("disk tier %s: dropped %d index records that do not fit this tier",
                        self.path, len(dropped))
            try:
                with self._env.begin(write=True, db=self._pages_db) as txn:
                    for record_key in dropped:
                        txn.delete(record_key)
            except _INDEX_ERRORS as exc:
                for record in records:
                    self.slots.free(record.slot, self.slot_bytes_for(record.payload_bytes))
                self._start_over(exc)
                return []
        return records

    def remember_namespace(self, namespace: Namespace) -> None:
        """Persist `namespace` so pages of it can be recovered after a restart."""
        record = _NamespaceRecord(namespace.model_id, namespace.dtype, namespace.layout,
                                  namespace.page_tokens, namespace.page_bytes, namespace.tp_rank,
                                  namespace.tp_world_size)
        try:
            with self._env.begin(write=True, db=self._namespaces_db) as txn:
                txn.put(namespace.fingerprint, msgspec.msgpack.encode(record), overwrite=True)
        except lmdb.Error as exc:
            raise StorageError(self._describe_index_error(exc)) from exc

    def forget_namespaces(self, fingerprints: Sequence[bytes]) -> None:
        """Remove these namespaces' records (no page of theirs is indexed any more)."""
        with self._env.begin(write=True, db=self._namespaces_db) as txn:
            for fingerprint in fingerprints:
                txn.delete(fingerprint)

    def namespaces(self) -> list[Namespace]:
        """Every namespace remembered in this directory. A record that does not decode is
        removed (its pages become misses: recovery drops records of unknown namespaces); an
        index that fails while being read is moved aside, and the tier starts empty."""
        decoder = msgspec.msgpack.Decoder(_NamespaceRecord)
        found: list[Namespace] = []
        damaged: list[bytes] = []
        try:
            with self._env.begin(db=self._namespaces_db) as txn:
                raw = [(bytes(key), bytes(value)) for key, value in txn.cursor()]
            for fingerprint, value in raw:
                try:
                    namespace = Namespace(**msgspec.structs.asdict(decoder.decode(value)))
                except (msgspec.MsgspecError, ValueError, TypeError, KvtierError):
                    namespace = None
                if namespace is None or namespace.fingerprint != fingerprint:
                    damaged.append(fingerprint)
                else:
                    found.append(namespace)
            if damaged:
                log.warning("disk tier %s: dropped %d namespace records that do not decode",
                            self.path, len(damaged))
                self.forget_namespaces(damaged)
        except lmdb.Error as exc:
            self._start_over(exc)
            return []
        return found

    def write_pages(self, writes: Sequence[DiskWrite],
                    overlap: Callable[[], None] | None = None) -> None:
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
        writes fail before it.

        Raises:
            StorageError: the file system is full or failed; none of `writes` is indexed.
        """
        indexed = False
        try:
            if writes:
                ordered = sorted(writes, key=_slot_of)
                last = ordered[-1]
                self._ensure_allocated(last.slot + self.slot_bytes_for(_payload(last).nbytes))
                self._write_runs(ordered)
            if overlap is not None:
                overlap()
            if writes:
                self._index(writes)
                indexed = True
                os.fdatasync(self._fd)
        except OSError as exc:
            if indexed:
                self.remove([(write.scoped_key, write.slot) for write in writes])
            raise StorageError(self._describe_os_error("write", exc)) from exc
        except lmdb.Error as exc:
            raise StorageError(self._describe_index_error(exc)) from exc

    def _write_runs(self, ordered: list[DiskWrite]) -> None:
        # One pass per page (hash, header, buffers): this loop is the per-page cost of a store.
        # A page is hashed just before its run is written, so the first run leaves early.
        slot_bytes_of = self._slot_bytes_by_payload
        buffers: list[bytes | memoryview | np.ndarray] = []
        run_start = run_end = -1
        for write in ordered:
            payload = _payload(write)
            payload_bytes = payload.nbytes
            slot_bytes = slot_bytes_of.get(payload_bytes) or self.slot_bytes_for(payload_bytes)
            if (write.slot != run_end or run_end - run_start + slot_bytes > WRITE_RUN_BYTES
                    or len(buffers) > MAX_RUN_BUFFERS):
                if buffers:
                    self._write_run(buffers, run_start, run_end - run_start)
                    buffers = []
                run_start = write.slot
            if write.checksum is None:
                write.checksum = payload_checksum(payload)
            buffers.append(pack_header(write.scoped_key, payload_bytes, write.checksum))
            buffers.append(payload)
            padding = slot_bytes - HEADER_BYTES - payload_bytes
            if padding:
                buffers.append(_ZEROS[:padding])
            run_end = write.slot + slot_bytes
        self._write_run(buffers, run_start, run_end - run_start)

    def _write_run(self, buffers: list, offset: int, run_bytes: int) -> None:
        written = os.pwritev(self._fd, buffers, offset)
        if written != run_bytes:
            raise OSError(errno.EIO, f"short write ({written} of {run_bytes} bytes)")
        start_writeback(self._fd, offset, run_bytes)

    def _index(self, writes: Sequence[DiskWrite]) -> None:
        pack = _RECORD.pack
        items = [(_record_key(w.scoped_key, w.slot), pack(w.slot, _payload(w).nbytes, w.checksum,
                                                          0.0, 0)) for w in writes]
        with self._env.begin(write=True, db=self._pages_db) as txn:
            txn.cursor().putmulti(items)
        self._sync_index_if_due()

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
                reason = self._describe_os_error("read", exc)
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

    def remove(self, keys_and_slots: Sequence[tuple[bytes, int]]) -> None:
        """Delete the index records of these (scoped key, slot) pairs; the slots may then be reused.

        Records are named by key and slot, so dropping an old copy of a page never removes a
        newer copy of the same key stored meanwhile in another slot.
        """
        with self._env.begin(write=True, db=self._pages_db) as txn:
            for scoped_key, slot in keys_and_slots:
                txn.delete(_record_key(scoped_key, slot))
        self._sync_index_if_due()

    def records(self) -> Iterator[DiskRecord]:
        """Every record in the index, for recovery and integrity walks."""
        with self._env.begin(db=self._pages_db) as txn:
            for record_key, value in txn.cursor():
                yield DiskRecord(bytes(record_key[:32]), *_RECORD.unpack(value))

    def save_access(self, records: Sequence[DiskRecord]) -> None:
        """Persist access data (last access, hits) of indexed pages in one transaction."""
        with self._env.begin(write=True, db=self._pages_db) as txn:
            for r in records:
                record_key = _record_key(r.scoped_key, r.slot)
                if txn.get(record_key) is not None:
                    txn.put(record_key, _RECORD.pack(r.slot, r.payload_bytes, r.checksum,
                                                     r.last_access_s, r.hits))

    def _describe_index_error(self, exc: lmdb.Error) -> str:
        if isinstance(exc, lmdb.MapFullError):
            return (f"disk tier index {self.path / 'index'} is full ({self._map_size >> 20} MiB "
                    f"mapped); restart the daemon: it maps twice the index's size and forgets "
                    f"namespaces that hold no pages")
        return f"disk tier index {self.path} failed: {exc}"

    def _describe_os_error(self, action: str, exc: OSError) -> str:
        if exc.errno == errno.ENOSPC:
            return f"disk tier file system is full ({self.path}): cannot {action} pages"
        return f"disk tier {action} failed in {self.path}: {exc.strerror or exc}"

    def close(self) -> None:
        """Sync and close the index and the slot file (idempotent)."""
        if self._fd < 0:
            return
        self._writer.shutdown(wait=True)
        self._env.sync(True)
        self._env.close()
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._fd = -1
        os.close(self._lock_fd)


def _payload(write: DiskWrite) -> np.ndarray:
    assert write.payload is not None  # only a DiskLedger takes writes without bytes
    return write.payload


def _slot_of(item: DiskWrite | DiskRead) -> int:
    return item.slot


def _file_bytes(path: Path) -> int:
    """The size of `path`, 0 when it does not exist or cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _make_private_dirs(path: Path) -> None:
    """`path` and its missing parents, each created 0700 (Path.mkdir gives parents 0777 & umask)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)


def _make_private(index_path: Path) -> None:
    """Tighten an index an older kvtier left readable by others (0755, files 0644)."""
    if not index_path.is_dir() or index_path.is_symlink():
        return
    try:
        os.chmod(index_path, 0o700)
        for name in ("data.mdb", "lock.mdb"):
            file_path = index_path / name
            if file_path.is_file() and not file_path.is_symlink():
                os.chmod(file_path, 0o600)
    except OSError as exc:  # not ours to change: say so, and serve
        log.warning("cannot make the disk tier index %s private: %s", index_path, exc)


def _decode_record(record_key: bytes, value: bytes) -> DiskRecord | None:
    """The record stored under `record_key`, or None when it is malformed or names a slot other
    than its key's (a damaged record: trusting either slot could serve another page)."""
    if len(record_key) != 40 or len(value) != _RECORD.size:
        return None
    record = DiskRecord(record_key[:32], *_RECORD.unpack(value))
    return record if record_key[32:] == record.slot.to_bytes(8, "big") else None


def _record_key(scoped_key: bytes, slot: int) -> bytes:
    """The index key of one page copy: its scoped key, then its slot offset."""
    return scoped_key + slot.to_bytes(8, "big")


def _runs(items: list, slot_bytes_of, max_run_bytes: int = MAX_RUN_BYTES) -> Iterator[list]:
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
