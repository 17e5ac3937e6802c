"""The disk tier's index: which page each slot holds, and the namespaces, in LMDB.

The index (key -> slot, length, checksum, access data) is small and transactional, which is what
LMDB is good at; the payloads live in the slot file (kvtier/tiers/slot_file.py).

Durability: the index commit that makes a page visible reaches the page cache at once and the
disk within INDEX_SYNC_INTERVAL_S. A killed daemon loses nothing; an OS crash can lose the last
second of index updates (those pages become misses). An index delete is committed before its slot
may be rewritten, and every read is verified, so no crash can make a page serve another page's
bytes. An index that is damaged (checked before LMDB maps it, or failing while recovery reads it)
is moved aside under a name no start opens again, and rebuilt from the slot file's verified pages
(kvtier/tiers/index_rebuild.py); without a layout file to read it by, the tier starts empty.

Verbs: `recover`, `add`, `remove`, `records`, `save_access`, `remember_namespace`,
`forget_namespaces`, `namespaces`, `sync`, `start_over`, `rebuild`, `describe_error`, `close`.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import lmdb
import msgspec

from kvtier.errors import KvtierError, StorageError
from kvtier.keys import Namespace
from kvtier.tiers.index_file import index_file_problem
from kvtier.tiers.index_rebuild import TierLayout, scan_slot_file
from kvtier.tiers.slot_file import DISK_ALIGNMENT, SLOT_FILE_NAME, DiskWrite, payload_of
from kvtier.tiers.slots import SlabAllocator

# The disk tier's one logger name, whichever of its modules logs: operators filter on it.
log = logging.getLogger("kvtier.tiers.disk")

# Index commits are made durable at least this often (and at close), not one fsync each.
INDEX_SYNC_INTERVAL_S = 1.0
# slot offset, payload bytes, checksum, last access (epoch s), hits
_RECORD = struct.Struct("<QQQdI")
# 2: index records named by key and slot; 3: slots packed at 64 bytes; 4: records keyed by slot
# first, in their own database, so a store's pages (adjacent slots) share the index's leaves
_FORMAT = b"kvtier-disk-4"
_RECORDS_DB = b"pages_by_slot"
# Format 3 keyed records by scoped key first: every page of a store dirtied a leaf of its own
# (3.0-3.7 us a page with 50,000-200,000 pages indexed, against 0.25 slot first). Opening such
# an index rewrites its records (`_upgrade_key_first_records`).
_KEY_FIRST_FORMAT = b"kvtier-disk-3"
_KEY_FIRST_DB = b"pages"
_UPGRADE_BATCH = 65536  # records a transaction of the rewrite
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


class _NamespaceRecord(msgspec.Struct, frozen=True):
    model_id: str
    dtype: str
    layout: str
    page_tokens: int
    page_bytes: int
    tp_rank: int
    tp_world_size: int


class DiskIndex:
    """The LMDB index of one disk tier directory.

    Args:
        path: the disk tier's directory (the index is its `index` subdirectory).
        capacity_bytes: most bytes of slots the tier may hold (sizes the map).
        chunk_bytes: slot file allocation unit asked for; the index keeps the one it was made
            with (`chunk_bytes` after opening).
        on_damage: called with the error when the index fails while being read after opening;
            it is to call `start_over` and forget the slot file's pages.

    Raises:
        StorageError: the index has an older format, or cannot be opened even empty.
    """

    def __init__(self, path: Path, capacity_bytes: int, chunk_bytes: int,
                 on_damage: Callable[[BaseException], None]) -> None:
        self.path = path
        self._on_damage = on_damage
        # The map size is address space, not disk: about 150 bytes of index per page of >= 4 KiB.
        # Twice what the index holds: an index that filled its map (MDB_MAP_FULL) has room again
        # after a restart, to drop what recovery drops and to take new pages.
        self._map_size = max(256 << 20, capacity_bytes // 16, 2 * _file_bytes(
            self.path / "index" / "data.mdb"))
        # The slot file's chunk size and the namespaces, kept beside the index: what rebuilding
        # a lost index from the slot file needs (`rebuild`).
        self._layout = TierLayout.load(path)
        # True when the index was found damaged at open and started empty: the caller rebuilds.
        self.damaged_at_open = False
        wanted = self._layout.chunk_bytes if self._layout else min(chunk_bytes, capacity_bytes)
        lost = (self._layout is not None and _file_bytes(path / SLOT_FILE_NAME) > 0
                and not (path / "index" / "data.mdb").exists())
        self._env, self.chunk_bytes = self._open_index(wanted)
        if lost:  # pages in the slot file, and no index at all (deleted, or never synced)
            log.error("disk tier index %s is missing beside a slot file of pages",
                      path / "index")
            self.damaged_at_open = True
        if self._layout is None or self._layout.chunk_bytes != self.chunk_bytes:
            self._layout = TierLayout(self.chunk_bytes)
            self._save_layout()
        self._last_index_sync_s = time.monotonic()
        self.sync()
        # Runs the periodic index fsync off the callers' path (stores write in their own thread).
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-writer")

    def _open_index(self, chunk_bytes: int) -> tuple[lmdb.Environment, int]:
        # Commits are not fsync'd one by one (`sync` does it, at most every
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
                self._pages_db = env.open_db(_RECORDS_DB)
                self._namespaces_db = env.open_db(b"namespaces")
                self._meta_db = env.open_db(b"meta")
                self._upgrade_key_first_records()
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
                if self._layout is None:  # nothing says how to read the slot file: start empty
                    (self.path / SLOT_FILE_NAME).unlink(missing_ok=True)
                else:
                    self.damaged_at_open = True
        raise AssertionError("unreachable")

    def _move_index_aside(self, exc: BaseException) -> None:
        """Keep a damaged index for a post-mortem, under a name no start opens again."""
        index_path = self.path / "index"
        aside = index_path.with_name(f"index.unreadable-{time.time_ns()}")
        log.error("disk tier index %s is unreadable (%s: %s); moved to %s, %s", index_path,
                  type(exc).__name__, exc, aside, "rebuilding it from the slot file"
                  if self._layout is not None else "starting empty (no layout file to rebuild by)")
        index_path.rename(aside)

    def start_over(self, exc: BaseException, chunk_bytes: int) -> None:
        """The index failed while being read: move it aside and start on an empty one made with
        `chunk_bytes`. The caller forgets the slot file's pages (none is indexed any more)."""
        self._env.close()
        self._move_index_aside(exc)
        self._env, _ = self._open_index(chunk_bytes)
        self.sync()

    @property
    def can_rebuild(self) -> bool:
        """Whether a layout says how to read the slot file (see `rebuild`)."""
        return self._layout is not None

    def rebuild(self, slot_fd: int, file_bytes: int, alignment: int) -> int:
        """Index every verified page of the slot file (after the index was lost); returns how
        many. The namespaces come back from the layout."""
        assert self._layout is not None
        layout = self._layout
        log.warning("disk tier %s: rebuilding the index from %s (%d bytes, %d namespaces)",
                    self.path, SLOT_FILE_NAME, file_bytes, len(layout.namespaces))
        for namespace in layout.namespaces.values():
            self.remember_namespace(namespace)
        now = time.time()
        num_pages = 0
        batch: list[tuple[bytes, bytes]] = []
        for page in scan_slot_file(slot_fd, file_bytes, layout, alignment):
            batch.append((_record_key(page.scoped_key, page.slot),
                          _RECORD.pack(page.slot, page.payload_bytes, page.checksum, now, 0)))
            if len(batch) >= 4096:
                num_pages += self._put_records(batch)
        num_pages += self._put_records(batch)
        self.sync()
        log.warning("disk tier %s: index rebuilt from the slot file: %d verified pages came back",
                    self.path, num_pages)
        return num_pages

    def _put_records(self, batch: list[tuple[bytes, bytes]]) -> int:
        count = len(batch)
        if batch:
            with self._env.begin(write=True, db=self._pages_db) as txn:
                txn.cursor().putmulti(batch)
            batch.clear()
        return count

    def _save_layout(self) -> None:
        assert self._layout is not None
        try:
            self._layout.save(self.path)
        except OSError as exc:  # the tier works without it; only a rebuild would need it
            log.warning("cannot save the disk tier layout in %s: %s", self.path, exc)

    def sync(self) -> None:
        """Make every index commit so far durable (an fsync of the index)."""
        self._env.sync(True)
        self._last_index_sync_s = time.monotonic()

    def _sync_index_if_due(self) -> None:
        if time.monotonic() - self._last_index_sync_s >= INDEX_SYNC_INTERVAL_S:
            self._last_index_sync_s = time.monotonic()
            self._writer.submit(self._env.sync, True)  # off the caller's path

    def _upgrade_key_first_records(self) -> None:
        """Rewrite the records of a format-3 index (keyed scoped key first) slot first.

        Batches go into the new database; the old one is dropped and the format changed in one
        last transaction, so a rewrite cut short leaves format 3 and starts over at the next
        open. Records that do not decode are carried as they are: recovery drops them. The
        index file grows to about 3.5 times its size (1,000,000 records: 123 MiB to 436, 4 s);
        later stores reuse the pages freed.
        """
        env = self._env
        with env.begin(db=self._meta_db) as txn:
            if txn.get(b"format") != _KEY_FIRST_FORMAT:
                return
        index_bytes = _file_bytes(self.path / "index" / "data.mdb")
        log.warning("disk tier %s: rewriting the index (%d MiB) from format %s to %s",
                    self.path, index_bytes >> 20, _KEY_FIRST_FORMAT.decode(), _FORMAT.decode())
        if 5 * index_bytes > self._map_size:  # room for both databases and their copies
            self._map_size = 5 * index_bytes
            env.set_mapsize(self._map_size)
        old_db = env.open_db(_KEY_FIRST_DB)
        with env.begin(write=True) as txn:
            txn.drop(self._pages_db, delete=False)  # what a rewrite cut short left
        num_records = 0
        start: bytes | None = b""
        while start is not None:
            batch, start = self._key_first_batch(old_db, start)
            num_records += self._put_records(batch)
        with env.begin(write=True) as txn:
            txn.drop(old_db, delete=True)
            txn.put(b"format", _FORMAT, db=self._meta_db)
        log.warning("disk tier %s: index records rewritten from format %s to %s (%d records)",
                    self.path, _KEY_FIRST_FORMAT.decode(), _FORMAT.decode(), num_records)

    def _key_first_batch(self, old_db: lmdb._Database, start: bytes
                         ) -> tuple[list[tuple[bytes, bytes]], bytes | None]:
        """Up to _UPGRADE_BATCH format-3 records from old key `start` on, as (new key, value),
        and the old key the next batch starts from (None after the last record).

        Read in a transaction of its own: LMDB reuses the pages a commit frees only once no
        reader is older than the commit, so a read held across the rewrite would grow the file
        by a copy of the new records per batch.
        """
        batch: list[tuple[bytes, bytes]] = []
        with self._env.begin(db=old_db) as reading:
            cursor = reading.cursor()
            if not cursor.set_range(start):
                return batch, None
            for old_key, value in cursor:
                old_key = bytes(old_key)
                new_key = old_key[32:] + old_key[:32] if len(old_key) == 40 else old_key
                batch.append((new_key, bytes(value)))
                if len(batch) >= _UPGRADE_BATCH:
                    return batch, old_key + b"\0"
        return batch, None

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

    def recover(self, page_bytes_by_fingerprint: dict[bytes, int], slots: SlabAllocator,
                slot_bytes_for: Callable[[int], int]) -> list[DiskRecord]:
        """Claim every usable record's slot in `slots` and return the records.

        Records that do not decode, or whose namespace is unknown, or whose slot is out of range or
        collides with another, are removed from the index by their own key (logged); their pages
        are misses from now on. An index that fails while being read goes to `on_damage`, and
        nothing is recovered.
        """
        try:
            with self._env.begin(db=self._pages_db) as txn:
                raw_records = [(bytes(key), bytes(value)) for key, value in txn.cursor()]
        except _INDEX_ERRORS as exc:
            self._on_damage(exc)
            return []
        records: list[DiskRecord] = []
        dropped: list[bytes] = []
        seen: set[bytes] = set()
        for record_key, value in raw_records:
            record = _decode_record(record_key, value)
            page_bytes = (page_bytes_by_fingerprint.get(record.scoped_key[:16])
                          if record is not None else None)
            # A key can have two records after a crash (a store racing its own delete); keys name
            # content, so either copy is right: keep the first.
            if (record is None or record.scoped_key in seen
                    or page_bytes != record.payload_bytes
                    or not slots.claim(record.slot, slot_bytes_for(record.payload_bytes))):
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
                    slots.free(record.slot, slot_bytes_for(record.payload_bytes))
                self._on_damage(exc)
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
            raise StorageError(self.describe_error(exc)) from exc
        if self._layout is not None and namespace.fingerprint not in self._layout.namespaces:
            self._layout.namespaces[namespace.fingerprint] = namespace
            self._save_layout()

    def forget_namespaces(self, fingerprints: Sequence[bytes]) -> None:
        """Remove these namespaces' records (no page of theirs is indexed any more)."""
        with self._env.begin(write=True, db=self._namespaces_db) as txn:
            for fingerprint in fingerprints:
                txn.delete(fingerprint)
        if self._layout is not None:
            for fingerprint in fingerprints:
                self._layout.namespaces.pop(fingerprint, None)
            self._save_layout()

    def namespaces(self) -> list[Namespace]:
        """Every namespace remembered in this directory. A record that does not decode is
        removed (its pages become misses: recovery drops records of unknown namespaces); an
        index that fails while being read goes to `on_damage`, and none is returned."""
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
            self._on_damage(exc)
            return []
        if self._layout is not None:  # an index older than its layout file: fill the layout
            missing = [ns for ns in found if ns.fingerprint not in self._layout.namespaces]
            self._layout.namespaces.update((ns.fingerprint, ns) for ns in missing)
            if missing:
                self._save_layout()
        return found

    def add(self, writes: Sequence[DiskWrite]) -> None:
        """Index `writes` (their payloads written, checksums set) in one transaction.

        Raises:
            lmdb.Error: the commit failed (the caller says why with `describe_error`).
        """
        pack = _RECORD.pack
        items = [(_record_key(w.scoped_key, w.slot), pack(w.slot, payload_of(w).nbytes,
                                                          w.checksum, 0.0, 0)) for w in writes]
        with self._env.begin(write=True, db=self._pages_db) as txn:
            txn.cursor().putmulti(items)
        self._sync_index_if_due()

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
                yield DiskRecord(_scoped_key_of(bytes(record_key)), *_RECORD.unpack(value))

    def save_access(self, records: Sequence[DiskRecord]) -> None:
        """Persist access data (last access, hits) of indexed pages in one transaction."""
        with self._env.begin(write=True, db=self._pages_db) as txn:
            for r in records:
                record_key = _record_key(r.scoped_key, r.slot)
                if txn.get(record_key) is not None:
                    txn.put(record_key, _RECORD.pack(r.slot, r.payload_bytes, r.checksum,
                                                     r.last_access_s, r.hits))

    def describe_error(self, exc: lmdb.Error) -> str:
        """A sentence for a failed index operation a user can act on."""
        if isinstance(exc, lmdb.MapFullError):
            return (f"disk tier index {self.path / 'index'} is full ({self._map_size >> 20} MiB "
                    f"mapped); restart the daemon: it maps twice the index's size and forgets "
                    f"namespaces that hold no pages")
        return f"disk tier index {self.path} failed: {exc}"

    def close(self) -> None:
        """Wait for a periodic sync under way, sync, and close the index."""
        self._writer.shutdown(wait=True)
        self._env.sync(True)
        self._env.close()


def _file_bytes(path: Path) -> int:
    """The size of `path`, 0 when it does not exist or cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


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
    record = DiskRecord(_scoped_key_of(record_key), *_RECORD.unpack(value))
    return record if record_key == _record_key(record.scoped_key, record.slot) else None


def _record_key(scoped_key: bytes, slot: int) -> bytes:
    """The index key of one page copy: its slot offset, then its scoped key. Slot first: the
    pages of one store sit in adjacent slots, so their records share the B-tree's leaves."""
    return slot.to_bytes(8, "big") + scoped_key


def _scoped_key_of(record_key: bytes) -> bytes:
    """The scoped key a record key (`_record_key`) names."""
    return record_key[8:]
