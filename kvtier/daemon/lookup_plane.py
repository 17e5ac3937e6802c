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
them all. A thread beats every `BEAT_S` (`IndexWriter.beat`), so the index of a killed daemon
stops answering within `ALIVE_NS`.
Unpublishing waits for the next publish, beat, `index_for` or delete and is written with the other
keys gone meanwhile: a stale answer errs only towards a page gone at recall time, and a store's
evictions cost one write for all.
Verbs: `LookupPlane.index_for`, `num_refused`, `total_refused`, `close`; `page_ready` /
`pages_ready` / `page_gone` / `pages_gone_now` / `shrink` for the store.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import threading
from collections.abc import Sequence

from kvtier.key_index import BEAT_S, IndexWriter, SegmentLayout, rebuild_groups
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.store.pages import PageEntry

F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; Python's fcntl does not name it
INDEX_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


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
        os.close(self.fd)
        # The writer's views of the mapping go with it; the mapping itself closes when unused.
        del self.writer, self._view
        try:
            self._map.close()
        except BufferError:
            pass  # a view still exported: the mapping is freed with its last reference


class LookupPlane:
    """Per namespace, the index of the keys the store holds; the store's page observer."""

    def __init__(self, store: PageStore) -> None:
        self._store = store
        self._segments: dict[bytes, IndexSegment] = {}
        self._generations = itertools.count(1)
        self._closed = False
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
            while keys:
                writer = segment.writer
                room = writer.room()
                writer.insert_many(keys[:room])
                del keys[:room]
                if writer.needs_rebuild():
                    segment = self._rebuild(fingerprint, segment)

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
                segment.writer.remove_many(keys)

    def shrink(self) -> int:
        """Nothing to give back: the writers keep no per-key objects (their tables are their
        record of where each key is)."""
        return 0

    def _rebuild(self, fingerprint: bytes, old: IndexSegment) -> IndexSegment:
        new = IndexSegment(fingerprint, rebuild_groups(old.writer.num_keys),
                           next(self._generations))
        # Keys the old index refused stay counted (and unpublished: not offered again).
        new.writer.num_refused = old.writer.num_refused
        new.writer.load_joined(old.writer.joined_keys())
        self._segments[fingerprint] = new  # complete before the old one tells readers to move
        old.retire()
        return new

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
            for segment in self._segments.values():
                segment.retire()
            self._segments.clear()

        self._store.call_locked(retire_all)
