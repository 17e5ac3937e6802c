"""The daemon's side of the lookup plane: a read-only key index per namespace, kept in step with
the page table.

`LookupPlane` observes the store (`PageStore.observe_pages`): a page that becomes READY is
published in its namespace's index, a page that leaves the table is unpublished, both under the
store's lock, so the index never shows a key the store has not made visible (`kvtier.key_index`
explains why a reader can trust what it reads). Each index is a memfd sealed against growing,
shrinking and any write but through the daemon's own mapping (`F_SEAL_FUTURE_WRITE`): a client
opens it read-only through `/proc/<daemon pid>/fd/<fd>` (the `lookup_index` verb names the fd)
and can neither write it nor make the daemon fault. When an index fills, a new one is built with
the next generation and the old one retired (its clients ask again); closing the plane retires
them all. An index of `BACKGROUND_KEYS` keys or more is rebuilt on a thread of its own, from a
copy of its slots taken when it is nearly full, while the store goes on: the publishes and
unpublishes made meanwhile are journalled and replayed into the new index before it replaces
the old one (under the lock, a rebuild of a million keys held every request for 0.12 s; the copy
takes a few ms). A thread beats every `BEAT_S` (`IndexWriter.beat`), so the index of a killed
daemon stops answering within `ALIVE_NS`.
Unpublishing waits for the next publish, beat, `index_for` or delete and is written with the other
keys gone meanwhile: a stale answer errs only towards a page gone at recall time, and a store's
evictions cost one write for all.
Verbs: `LookupPlane.index_for`, `num_refused`, `total_refused`, `close`; `page_ready` /
`pages_ready` / `page_gone` / `pages_gone_now` / `shrink` for the store.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from kvtier.key_index import (
    BEAT_S,
    EARLY_LOAD,
    IndexWriter,
    SegmentLayout,
    joined,
    rebuild_groups,
)
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.store.pages import PageEntry

log = logging.getLogger(__name__)

F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; Python's fcntl does not name it
INDEX_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Indexes of this many keys are rebuilt off the store's lock; smaller ones under it (a few ms).
BACKGROUND_KEYS = 1 << 16
# From this fill on, a large index's snapshot memory is faulted in, off the lock, before the
# snapshot at `EARLY_LOAD`.
SNAPSHOT_MEMORY_LOAD = EARLY_LOAD - 0.05
BUILDER_PASSES = 4  # over the journal, off the lock: what is journalled after is replayed under it


class IndexSegment:
    """One namespace's index: a sealed memfd, the daemon's writable mapping, its writer."""

    def __init__(self, fingerprint: bytes, num_groups: int, generation: int) -> None:
        layout = SegmentLayout.for_groups(num_groups)
        self.fd = os.memfd_create(f"kvtier-index-{fingerprint.hex()[:12]}",
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, layout.size_bytes)
            self._map = mmap.mmap(self.fd, layout.size_bytes)
            # Sealed once mapped: the daemon's mapping stays writable, no new one can be.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, INDEX_SEALS)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = memoryview(self._map)
        self.writer = IndexWriter(self._view, layout, generation, fingerprint)

    @property
    def size_bytes(self) -> int:
        """The segment's length."""
        return self.writer.layout.size_bytes

    def retire(self) -> None:
        """Tell readers to ask for the new index; close our side (readers keep their mappings)."""
        self.writer.retire()
        self.close()

    def close(self) -> None:
        """Close our side of a retired index (an unmap: ms for a large one)."""
        os.close(self.fd)
        # The writer's views of the mapping go with it; the mapping itself closes when unused.
        del self.writer, self._view
        try:
            self._map.close()
        except BufferError:
            pass  # a view still exported: the mapping is freed with its last reference


@dataclass(slots=True)
class Rebuild:
    """A namespace's next index, building off the store's lock, and what changed since its
    snapshot: (published?, keys) in order, replayed into it (the most by its builder, the rest
    under the lock) before it replaces the old one."""

    journal: list[tuple[bool, bytes]] = field(default_factory=list)  # keys joined
    replayed: int = 0  # entries of `journal` in the new index already
    segment: Future[IndexSegment] = field(init=False)  # set as the build is started

    def catch_up(self, segment: IndexSegment, passes: int | None = None) -> None:
        """Replay the journal into `segment`: to its end, or `passes` times to where it ended
        as the pass began (the builder's: the store may journal faster than it replays). A
        run of publishes or of unpublishes is one write, a large one without the GIL (entry
        by entry, the builder's Python kept the GIL from the daemon's threads)."""
        journal, writer = self.journal, segment.writer
        for _ in itertools.repeat(None) if passes is None else range(passes):
            end = len(journal)  # appended under the store's lock meanwhile: read its length once
            if self.replayed == end:
                return
            for published, run in itertools.groupby(journal[self.replayed:end],
                                                     key=itemgetter(0)):
                raw = b"".join(keys for _, keys in run)
                if published:
                    writer.insert_joined(raw)
                else:
                    writer.remove_joined(raw)
            self.replayed = end


def write_keys(writer: IndexWriter, keys: list[bytes], published: bool,
               rebuild: Rebuild | None) -> None:
    """Publish (or unpublish) `keys` in `writer`'s index and, while its successor builds, in
    that one's journal: joined once, for both."""
    if rebuild is None:
        (writer.insert_many if published else writer.remove_many)(keys)
        return
    raw = joined(keys)
    (writer.insert_joined if published else writer.remove_joined)(raw)
    rebuild.journal.append((published, raw))


def faulted_in(num_bytes: int) -> np.ndarray:
    """`num_bytes` of memory, touched: a snapshot copied into it under the store's lock costs
    the copy only."""
    memory = np.empty(num_bytes, np.uint8)
    memory[::mmap.PAGESIZE] = 0
    return memory


def build_segment(fingerprint: bytes, num_groups: int, generation: int, num_refused: int,
                  slots: np.ndarray) -> IndexSegment:
    """A new index holding the keys of `slots` (an old one's `slots_copy`)."""
    segment = IndexSegment(fingerprint, num_groups, generation)
    try:
        # Keys the old index refused stay counted (and unpublished: not offered again).
        segment.writer.num_refused = num_refused
        segment.writer.load_joined(slots)
    except BaseException:
        segment.retire()
        raise
    return segment


def build_off_lock(rebuild: Rebuild, fingerprint: bytes, num_groups: int, generation: int,
                   num_refused: int, slots: np.ndarray) -> IndexSegment:
    """`build_segment`, then what the store journalled while it loaded."""
    segment = build_segment(fingerprint, num_groups, generation, num_refused, slots)
    rebuild.catch_up(segment, passes=BUILDER_PASSES)
    return segment


class LookupPlane:
    """Per namespace, the index of the keys the store holds; the store's page observer.
    Indexes of `background_keys` keys or more are rebuilt off the store's lock."""

    def __init__(self, store: PageStore, background_keys: int = BACKGROUND_KEYS) -> None:
        self._store = store
        self._segments: dict[bytes, IndexSegment] = {}
        self._generations = itertools.count(1)
        self._closed = False
        self._background_keys = background_keys
        self._rebuilds: dict[bytes, Rebuild] = {}
        self._snapshot_memory: dict[bytes, Future[np.ndarray]] = {}
        self._builder: ThreadPoolExecutor | None = None
        self._gone: list[bytes] = []  # scoped keys of pages gone, not yet unpublished
        self._stopped = threading.Event()
        store.observe_pages(self)
        self._beater = threading.Thread(target=self._beat, name="kvtier-index-beat", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        """Keep every index's `alive_until` ahead of now while the daemon runs."""
        def beat_all() -> None:
            if self._gone:
                self.pages_gone_now()
            if self._rebuilds:
                self._finish_rebuilds()
            for segment in self._segments.values():
                segment.writer.beat()

        while not self._stopped.wait(BEAT_S):  # a period, not a synchronisation
            self._store.call_locked(beat_all)

    def _segment(self, fingerprint: bytes) -> IndexSegment:
        segment = self._segments.get(fingerprint)
        if segment is None:
            segment = IndexSegment(fingerprint, rebuild_groups(0), next(self._generations))
            self._segments[fingerprint] = segment
        return segment

    def page_ready(self, entry: PageEntry) -> None:
        """Publish `entry`'s key in its namespace's index (a rebuild when the index fills)."""
        self.pages_ready((entry,))

    def pages_ready(self, entries: Sequence[PageEntry]) -> None:
        """Publish the keys of `entries` (a store's pages), a namespace's in one write."""
        if self._gone:
            self.pages_gone_now()  # first: a key gone and stored again stays published
        if not entries:
            return
        namespace = entries[0].namespace
        by_namespace: dict[bytes, list[bytes]] = {}
        if all(entry.namespace is namespace for entry in entries):  # a store's: one namespace
            by_namespace[namespace.fingerprint] = [entry.scoped_key[16:] for entry in entries]
        else:
            for entry in entries:
                scoped_key = entry.scoped_key
                by_namespace.setdefault(scoped_key[:16], []).append(scoped_key[16:])
        for fingerprint, keys in by_namespace.items():
            segment = self._segments.get(fingerprint)
            if segment is None:
                if self._closed:
                    return
                segment = self._segment(fingerprint)
            rebuild = self._rebuilds.get(fingerprint)
            while keys:
                writer = segment.writer
                room = writer.room()
                write_keys(writer, keys[:room], True, rebuild)
                del keys[:room]
                if writer.needs_rebuild():
                    segment = self._rebuild(fingerprint, segment)
                    rebuild = None
            self._start_rebuild(fingerprint, segment)
        if self._rebuilds:
            self._finish_rebuilds()

    def page_gone(self, entry: PageEntry) -> None:
        """Unpublish `entry`'s key: queued, and written with the others gone by the next
        publish, beat, `index_for` or `pages_gone_now` (a delete), whichever comes first. Until
        then a reader may find the key and its recall miss, as for any page gone after a
        lookup."""
        self._gone.append(entry.scoped_key)

    def pages_gone_now(self) -> None:
        """Unpublish the keys of the pages reported gone so far."""
        gone, self._gone = self._gone, []
        by_namespace: dict[bytes, list[bytes]] = {}
        for scoped_key in gone:
            by_namespace.setdefault(scoped_key[:16], []).append(scoped_key[16:])
        for fingerprint, keys in by_namespace.items():
            segment = self._segments.get(fingerprint)
            if segment is not None:
                write_keys(segment.writer, keys, False, self._rebuilds.get(fingerprint))

    def shrink(self) -> int:
        """Nothing to give back: the writers keep no per-key objects (their tables are their
        record of where each key is)."""
        return 0

    def _rebuild(self, fingerprint: bytes, old: IndexSegment) -> IndexSegment:
        """Replace `old` by its successor: the one building (waited for) or, if none or it
        failed, one built now from `old`."""
        new = self._take_rebuild(fingerprint)
        if new is None or new.writer.needs_rebuild():  # (a journal that filled it: again)
            source = new or old
            new = build_segment(fingerprint, rebuild_groups(source.writer.num_keys),
                                next(self._generations), source.writer.num_refused,
                                source.writer.slots_copy())
            if source is not old:
                source.retire()  # never handed out
        new.writer.beat()  # built a while ago, maybe: alive from now
        self._snapshot_memory.pop(fingerprint, None)  # for `old`'s size
        self._segments[fingerprint] = new  # complete before the old one tells readers to move
        if self._builder is None:
            old.retire()
        else:  # a large one's unmap off the lock too
            old.writer.retire()
            self._builder.submit(old.close)
        return new

    def _start_rebuild(self, fingerprint: bytes, segment: IndexSegment) -> None:
        """Start building the successor of a large, nearly full index off the lock (and,
        a little before, fault in the memory its snapshot is copied into)."""
        writer = segment.writer
        if fingerprint in self._rebuilds or writer.num_keys < self._background_keys:
            return
        fill = writer.fill()
        if fill <= SNAPSHOT_MEMORY_LOAD:
            return
        if self._builder is None:
            self._builder = ThreadPoolExecutor(1, thread_name_prefix="kvtier-index-build")
        memory = self._snapshot_memory.get(fingerprint)
        if memory is None:
            memory = self._snapshot_memory[fingerprint] = self._builder.submit(
                faulted_in, writer.slots_bytes)
        if fill <= EARLY_LOAD:
            return
        del self._snapshot_memory[fingerprint]
        # (memory not faulted in yet, or for an index since replaced: new memory, as before)
        snapshot = writer.slots_copy(memory.result() if memory.done() else None)
        rebuild = self._rebuilds[fingerprint] = Rebuild()
        rebuild.segment = self._builder.submit(
            build_off_lock, rebuild, fingerprint, rebuild_groups(writer.num_keys),
            next(self._generations), writer.num_refused, snapshot)
        writer.stretch()  # stores fill it on meanwhile: a rebuild waited for is a stall

    def _finish_rebuilds(self) -> None:
        """Put in place every successor built by now."""
        for fingerprint, rebuild in list(self._rebuilds.items()):
            if rebuild.segment.done():
                self._rebuild(fingerprint, self._segments[fingerprint])

    def _take_rebuild(self, fingerprint: bytes) -> IndexSegment | None:
        """The successor building for `fingerprint`, waited for, with its journal replayed;
        None if none was building or its build failed (logged)."""
        rebuild = self._rebuilds.pop(fingerprint, None)
        if rebuild is None:
            return None
        try:
            segment = rebuild.segment.result()
        except Exception:
            log.exception("building a new lookup index failed; building it again now")
            return None
        rebuild.catch_up(segment)
        return segment

    def num_refused(self, namespace: Namespace) -> int:
        """Keys of `namespace`'s pages its index refused (`IndexWriter.insert`): held, yet
        read absent by clients' lookups."""
        segment = self._segments.get(namespace.fingerprint)
        return 0 if segment is None else segment.writer.num_refused

    def total_refused(self) -> int:
        """Keys refused by every namespace's index (`num_refused`), for the daemon's stats."""
        # A list first: the loop may add a namespace's index while the stats thread reads.
        return sum(segment.writer.num_refused for segment in list(self._segments.values()))

    def index_for(self, namespace: Namespace) -> tuple[int, int, int]:
        """(fd, generation, size in bytes) of `namespace`'s index, created empty if none yet."""
        def find() -> tuple[int, int, int]:
            if self._gone:
                self.pages_gone_now()
            if self._rebuilds:
                self._finish_rebuilds()
            segment = self._segment(namespace.fingerprint)
            return segment.fd, segment.writer.generation, segment.size_bytes

        # Under the store's lock, as the observer calls: one writer at a time.
        return self._store.call_locked(find)

    def close(self) -> None:
        """Stop observing the store and retire every index (clients fall back to the socket)."""
        self._stopped.set()
        self._beater.join()
        self._store.observe_pages(None)
        def retire_all() -> None:
            self._closed = True
            for fingerprint in list(self._rebuilds):
                building = self._take_rebuild(fingerprint)
                if building is not None:
                    building.retire()
            for segment in self._segments.values():
                segment.retire()
            self._segments.clear()

        self._store.call_locked(retire_all)
        if self._builder is not None:
            self._builder.shutdown(wait=True)
