"""The page store's side of the remote tier: what it sends, and what a local miss asks for.

Sends: under write mode "through" every page a store commits is framed and queued (other nodes
can reuse it at once); under "evict" a page is queued when its last local copy leaves (host
without a disk copy, or disk). Either way the bytes are copied while they are stable (the
caller's buffers during the store, a slot marked EVICTING), so a reused slot never reaches Redis.

Fetches: a lookup whose local prefix stops short asks the remote for the keys missing locally in
one round trip, keeps the leading run of verified pages, stores them in host (not sent back), and
reports them present; a recall or prefetch does the same for its missing keys.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures

import numpy as np

from kvtier.keys import Namespace
from kvtier.pools.page_access import PageAccess
from kvtier.store.pages import PageEntry, Tier, present_prefix
from kvtier.store.results import StoreResult
from kvtier.tiers.base import DiskStorage
from kvtier.tiers.disk import DiskRead
from kvtier.tiers.remote import RemoteTier, frame_page

log = logging.getLogger(__name__)

MAX_FETCH_BYTES = 512 << 20  # one lookup asks for at most this much


# Stores fetched pages in host: (namespace, keys, payloads, parent key) -> what was stored.
StoreFetched = Callable[[Namespace, list[bytes], list[memoryview], "bytes | None"], StoreResult]


class RemoteLink:
    """Connects a page store to one `RemoteTier`, through what it reads and one way to store.

    Args:
        remote: the tier.
        host_bytes: the host slot of an entry as bytes (for sends from host slots).
        disk: the disk tier, read for the pages whose last copy leaves it (None without one).
        store_fetched: stores fetched pages in host without sending them back (the store's
            `store` with `remote_write=False`).
    """

    def __init__(self, remote: RemoteTier,
                 host_bytes: Callable[[PageEntry], np.ndarray],
                 disk: DiskStorage | None, store_fetched: StoreFetched) -> None:
        self.remote = remote
        self._host_bytes = host_bytes
        self._disk = disk
        self._store_fetched_pages = store_fetched
        self.sends_on_store = remote.config.write == "through"
        # One thread: promotions of recalled pages run in order, off the recall's path.
        self._promoter = futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-promote")
        self._promotions: list[futures.Future] = []
        self._promotions_lock = threading.Lock()

    # -- sends --------------------------------------------------------------------------------

    def send_stored(self, namespace: Namespace, keys: Sequence[bytes], stored: Sequence[bytes],
                    sources: PageAccess) -> None:
        """Queue the pages of `stored` (a subset of `keys`, rows of `sources`) for the remote."""
        index_of = {key: i for i, key in enumerate(keys)}
        fingerprint = namespace.fingerprint
        self._put_all((fingerprint + key, sources.row(index_of[key]), None) for key in stored)

    def send_host_copies(self, entries: Sequence[PageEntry]) -> None:
        """Queue pages from their host slots, which the caller owns (WRITING, bytes complete)."""
        host_bytes = self._host_bytes
        self._put_all((e.scoped_key, host_bytes(e), None) for e in entries)

    def spill(self, tier: Tier, victims: list[PageEntry]) -> None:
        """Queue victims whose last local copy is leaving `tier` (their slot is EVICTING)."""
        leaving = [v for v in victims if not v.deleted and v.hbm is None and (
            (tier is Tier.HOST and v.disk is None) or (tier is Tier.DISK and v.host is None))]
        if tier is Tier.HOST:
            host_bytes = self._host_bytes
            self._put_all((v.scoped_key, host_bytes(v), v.checksum) for v in leaving)
        else:
            self._put_all(self._disk_payloads(leaving))

    def _put_all(self, pages: Iterable[tuple[bytes, np.ndarray | memoryview, int | None]]
                 ) -> None:
        """Frame and queue (scoped key, payload, checksum or None) until the queue refuses one:
        full, or the link is down, so the rest would be dropped too. `pages` is consumed lazily,
        so nothing is copied or read when the remote takes no writes."""
        if not self.remote.accepts_writes():
            return
        for scoped_key, payload, checksum in pages:
            if not self.remote.put(scoped_key, frame_page(scoped_key, payload, checksum)):
                return

    def _disk_payloads(self, victims: list[PageEntry]
                       ) -> Iterator[tuple[bytes, np.ndarray, int | None]]:
        """(scoped key, verified payload, checksum) of disk victims, read in one batch when
        first asked for (adjacent slots in one system call); unreadable ones are skipped."""
        disk = self._disk
        if disk is None:
            return
        reads = [DiskRead(v.scoped_key, v.residency_in(Tier.DISK).slot, v.namespace.page_bytes,
                          checksum, np.empty(v.namespace.page_bytes, np.uint8))
                 for v in victims if (checksum := v.checksum) is not None]
        if not reads:
            return
        problems = disk.read_pages(reads)
        for read in reads:
            if read.scoped_key not in problems:
                yield read.scoped_key, read.out, read.checksum

    # -- fetches ------------------------------------------------------------------------------

    def extend_prefix(self, namespace: Namespace, keys: Sequence[bytes],
                      tiers: list[Tier | None]) -> list[int]:
        """Fetch the keys missing locally after the present prefix; store the leading run.

        Updates `tiers` in place (Tier.HOST for each page now in host) and returns the indices
        that came from the remote. Stops fetching at the first remote miss: pages after it are
        of no use to an engine.
        """
        first_gap = present_prefix(tiers)
        wanted = [i for i in range(first_gap, len(keys)) if tiers[i] is None]
        wanted = wanted[: max(1, MAX_FETCH_BYTES // namespace.page_bytes)]
        if not wanted or not self.remote.connected:
            return []
        stored: list[int] = []
        chunks = self.remote.fetch_chunks([namespace.fingerprint + keys[i] for i in wanted],
                                          namespace.page_bytes)
        try:
            for first, payloads in chunks:
                indices = wanted[first : first + len(payloads)]
                run = list(itertools.takewhile(lambda pair: pair[1] is not None,
                                               zip(indices, payloads)))
                found = {i: p for i, p in run if p is not None}
                stored += self._store_fetched(namespace, keys, [i for i, _ in run], found,
                                              tiers)
                if len(run) < len(indices):
                    break
        finally:
            chunks.close()
        return stored

    def fetch_missing(self, namespace: Namespace, keys: Sequence[bytes], indices: list[int],
                      tiers: list[Tier | None],
                      on_chunk: Callable[[dict[int, memoryview]], None] | None = None
                      ) -> set[int]:
        """Fetch `indices` (missing locally) and store the verified pages in host.

        With `on_chunk` (a recall), each chunk's {index: payload} goes to it as it arrives and
        the host copies are made afterwards by the promotion thread, off the caller's critical
        path (`wait_promotions` waits for them). Without it (a prefetch), they are made before
        returning. Returns the indices found.
        """
        if not indices or not self.remote.connected:
            return set()
        fetched: dict[int, memoryview] = {}
        for first, payloads in self.remote.fetch_chunks(
                [namespace.fingerprint + keys[i] for i in indices], namespace.page_bytes):
            found = {i: p for i, p in zip(indices[first : first + len(payloads)], payloads)
                     if p is not None}
            if on_chunk is not None:
                on_chunk(found)
            fetched.update(found)
        if fetched and on_chunk is not None:
            with self._promotions_lock:
                self._promotions = [f for f in self._promotions if not f.done()]
                self._promotions.append(self._promoter.submit(
                    self._promote_in_background, namespace, list(keys), fetched, list(tiers)))
        elif fetched:
            self._store_fetched(namespace, keys, sorted(fetched), fetched, tiers)
        return set(fetched)

    def _promote_in_background(self, namespace: Namespace, keys: list[bytes],
                               fetched: dict[int, memoryview], tiers: list[Tier | None]) -> None:
        try:
            self._store_fetched(namespace, keys, sorted(fetched), fetched, tiers)
        except Exception:  # the recall was served; only the cache fill is lost
            log.exception("promoting %d recalled remote pages into host failed", len(fetched))

    def wait_promotions(self, timeout_s: float | None = None) -> None:
        """Block until every queued promotion of recalled remote pages is in host."""
        with self._promotions_lock:
            pending, self._promotions = self._promotions, []
        futures.wait(pending, timeout_s)

    def close(self) -> None:
        """Finish queued promotions; stop the promotion thread (before the store closes)."""
        self._promoter.shutdown(wait=True)

    def _store_fetched(self, namespace: Namespace, keys: Sequence[bytes], indices: list[int],
                       payloads: Mapping[int, memoryview],
                       tiers: list[Tier | None]) -> list[int]:
        """Store fetched pages in host, one call per run of adjacent keys (each with its parent)."""
        stored_indices: list[int] = []
        for run in _adjacent_runs(indices):
            parent = keys[run[0] - 1] if run[0] > 0 else None
            result = self._store_fetched_pages(namespace, [keys[i] for i in run],
                                               [payloads[i] for i in run], parent)
            failed = result.failed
            for i in run:
                if keys[i] not in failed:
                    tiers[i] = Tier.HOST
                    stored_indices.append(i)
            if failed:
                log.warning("%d pages fetched from the remote tier could not be stored: %s",
                            len(failed), next(iter(failed.values())))
        return stored_indices


def _adjacent_runs(indices: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
