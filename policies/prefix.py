"""Prefix-aware eviction: leaves of the prefix tree leave first, by measured hit density.

A page is useless once any page before it in its prefix is gone, so this policy never evicts a
page while a child of it (the next page of some prefix) is resident in the tier: victims are
always leaves of the tier's prefix tree, and the pages that remain always form whole prefixes.

Among the leaves, the one with the lowest hit density leaves first: the expected hits per slot
and unit of time a page of its class (use count, depth octave) still offers at its age, read
from a table measured on the tier's own traffic (`kvtier.policies.reuse`). Time is the tier's
clock, one tick per reference (insert or hit); a page's age runs from the start of the last
request that touched it: the pages one request touches in prefix order share that start, so a
request's pages age together, and ties go deepest page first (its tail before its head).

Finding the least dense leaf exactly: the density depends on a leaf's class and age only, so
leaves are filed in buckets of one class and one span of touch times (1/32 of the capacity
in ticks: finer than the table's age bins where evictions happen), oldest and deepest first
within a bucket; a heap orders the buckets by density, rebuilt when the clock enters a new
span or the table is rebuilt (every `capacity` references). A sampled choice
among leaves (LHD's) lost 2-3% of the hits on the Mooncake trace.

Admission keeps the tier's prefixes whole: `admit(key, parent)` refuses a key whose parent is
known to be gone from the tier (evicted, or itself refused) and is not being stored alongside it,
and a resident page that is the parent of an admitted page still being stored is never a victim.
A parent the tier never saw is no reason to refuse: on disk a demoted child arrives before its
parent, which is still in the host tier.

Verbs: `admit` checks a key's parent, `on_insert` and `on_access` reference a key, `on_remove`
forgets it, `choose_victim` (`victims`: one after another) evicts the least dense leaf the caller
lets go.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.dict_room import shrink_attributes
from kvtier.policies.base import CanEvict, EvictionPolicy, Key, Victims, first_victim
from kvtier.policies.prefix_tree import PrefixTree
from kvtier.policies.reuse import ReuseHistory

# History of references in multiples of the capacity: metadata only (see policies/reuse.py).
# It must span typical reuse distances, which in conversation traffic are several times any
# affordable capacity (a user thinks before the next turn).
HISTORY_FACTOR = 16
# Bucket span in fractions of the capacity (in ticks): finer buckets rank ages more exactly
# and cost more heap rebuilds. Spans of a quarter capacity (a table bin at the eviction age)
# left 1% of the hits at 5% capacity on the Mooncake trace (22.52 against 22.77) and made the
# 1% figure swing with the span (10.13-10.45); from 1/16 on it is steady (10.36-10.42).
BUCKETS_PER_CAPACITY = 32
# A heap rebuild costs the number of buckets, each span: in small tiers spans stay at least
# this many ticks (or a quarter of the capacity, if less), where exactness buys little.
MIN_BUCKET_SPAN = 32

_NOT_PENDING = object()
_NO_PAGE = ((None, None),)  # what follows a run's last page

_Leaf = tuple[int, int, Key]  # (touch time, -filing sequence, key): oldest, then deepest first


@dataclass(slots=True)
class _Page:
    """A resident page: its last touch, class, place in the prefix tree and leaf filing."""

    time: int
    page_class: int
    parent: Key | None
    depth: int
    filing: int = 0  # the filing that is current while the page is a leaf; 0: not filed


class PrefixPolicy(EvictionPolicy):
    """Leaf-first eviction of the page with the least measured hit density."""

    name = "prefix"
    history_type: type[ReuseHistory] = ReuseHistory  # the statistics leaves are ranked by

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        horizon = HISTORY_FACTOR * capacity_pages
        self.history = self.history_type(horizon, horizon)
        self._densities = self.history.hit_densities()
        # Its clock counts references: the unit of ages and reuse distances.
        self._tree: PrefixTree[_Page] = PrefixTree(self._file_leaf, self._unfile)
        self._key_to_page = self._tree.key_to_page  # read only, without a lookup per use
        self._num_refs_since_table = 0
        self._bucket_span = max(1, capacity_pages // BUCKETS_PER_CAPACITY,
                                min(capacity_pages // 4, MIN_BUCKET_SPAN))
        # Leaves by (page class, touch time // span). Stale entries (touched since, evicted,
        # or no longer leaves) are skipped when met: a heap cannot remove from the middle. A
        # bucket is compacted when mostly stale and dropped once it has no current leaf (when
        # met, at a heap rebuild, or when empty ones pile up), so stale entries stay within a
        # small multiple of the leaves.
        self._bucket_to_leaves: dict[tuple[int, int], list[_Leaf]] = {}
        self._bucket_to_num_leaves: dict[tuple[int, int], int] = {}
        self._bucket_heap: list[tuple[float, int, int]] = []  # (density, time bucket, class)
        self._heap_epoch = -1  # clock // span when the heap was built; -1: to rebuild
        self._num_filings = 0
        # Admitted keys not yet inserted, with their parents: the parents may not be evicted
        # meanwhile. The store admits a run of keys, makes room, then inserts them: an admitted
        # key not inserted by the next run's first `admit` was abandoned (its store failed),
        # so it counts as refused from then on.
        self._pending_to_parent: dict[Key, Key | None] = {}
        self._parent_to_num_pending: dict[Key, int] = {}
        self._admitting = False  # inside a run of `admit` calls
        self._refused: OrderedDict[Key, None] = OrderedDict()  # bounded by the capacity
        # Inside `on_insert_many`: leaves pushed into their buckets at its end.
        self._filing_later: list[tuple[tuple[int, int], _Leaf]] | None = None

    def admit(self, key: Key, parent: Key | None = None) -> bool:
        """Admit `key` unless its `parent` is known to be gone from this tier; the parent of an
        admitted key is kept until the key is inserted or the next run of admissions starts."""
        if not self._admitting:
            self._admitting = True
            for abandoned in self._pending_to_parent:
                self._refuse(abandoned)
            self._pending_to_parent.clear()
            self._parent_to_num_pending.clear()
        if parent is not None and parent not in self._key_to_page and (
                parent not in self._pending_to_parent
                and (parent in self.history or parent in self._refused)):
            self._refuse(key)
            return False
        if key in self._refused:
            del self._refused[key]
        if key in self._pending_to_parent:
            self._forget_pending(key)
        self._pending_to_parent[key] = parent
        if parent is not None:
            self._parent_to_num_pending[parent] = self._parent_to_num_pending.get(parent, 0) + 1
        return True

    def admit_many(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> list[bool]:
        """`admit` each (key, parent) in turn (a store's new pages): whether each may enter."""
        admitted = []
        pending, num_pending = self._pending_to_parent, self._parent_to_num_pending
        key_to_page, refused = self._key_to_page, self._refused
        for key, parent in keys_and_parents:
            if self._admitting and key not in refused and key not in pending and (
                    parent is None or parent in key_to_page or parent in pending):
                # `admit`, inline, where it admits at once (a chain's parent is pending)
                pending[key] = parent
                if parent is not None:
                    num_pending[parent] = num_pending.get(parent, 0) + 1
                admitted.append(True)
            else:
                admitted.append(self.admit(key, parent))
        return admitted

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident under `parent`; a key the history knows keeps its past uses."""
        self._admitting = False
        if key in self._pending_to_parent:
            self._forget_pending(key)
        if key in self._refused:
            del self._refused[key]
        if key in self._key_to_page:
            self.on_access(key)
            return
        parent_page = self._key_to_page.get(parent) if parent is not None else None
        if parent is None:
            depth = 0
        elif parent_page is not None:
            depth = parent_page.depth + 1
        else:  # a parent not resident here (on disk: it arrives after its child)
            parent_depth = self.history.depth(parent)
            depth = 0 if parent_depth is None else parent_depth + 1
        self._num_refs_since_table += 1
        time = self._tree.tick(key, parent)
        self._tree.add(key, _Page(time, self.history.reference(key, time, depth), parent, depth))

    def on_insert_many(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> None:
        """`on_insert` each (key, parent) in turn; leaves go into their buckets at the end. A
        store's new pages form a chain: each is a leaf only until the next arrives, so filing
        them one by one would push entries that are stale at once."""
        if self._is_new_chain(keys_and_parents):
            self._insert_new_chain(keys_and_parents)
            return
        later: list[tuple[tuple[int, int], _Leaf]] = []
        self._filing_later = later
        self._admitting = False
        self._forget_pending_many(key for key, _ in keys_and_parents)
        key_to_page, refused = self._key_to_page, self._refused
        tree, history = self._tree, self.history
        following = itertools.chain(itertools.islice(keys_and_parents, 1, None), _NO_PAGE)
        try:
            for (key, parent), (next_key, next_parent) in zip(keys_and_parents, following):
                if key in key_to_page or key in refused:  # `on_insert`'s rarer paths
                    self.on_insert(key, parent)
                    continue
                # `on_insert`, inline: most of a store's pages are new
                parent_page = key_to_page.get(parent) if parent is not None else None
                if parent is None:
                    depth = 0
                elif parent_page is not None:
                    depth = parent_page.depth + 1
                else:
                    parent_depth = history.depth(parent)
                    depth = 0 if parent_depth is None else parent_depth + 1
                self._num_refs_since_table += 1
                time = tree.tick(key, parent)
                page = _Page(time, history.reference(key, time, depth), parent, depth)
                if next_parent != key or next_key in key_to_page:
                    tree.add(key, page)
                elif tree.add_covered(key, page):  # its child comes next: not filed
                    self._note_bucket((page.page_class, time // self._bucket_span))
        finally:
            self._filing_later = None
        buckets, is_current = self._bucket_to_leaves, self._is_current
        for bucket, leaf in later:
            if is_current(leaf):  # still a leaf, filed under this filing
                leaves = buckets[bucket]  # kept: it counts a current leaf
                heapq.heappush(leaves, leaf)
                if len(leaves) > 2 * self._bucket_to_num_leaves[bucket] + 8:
                    leaves[:] = [entry for entry in leaves if is_current(entry)]
                    heapq.heapify(leaves)

    def _is_new_chain(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> bool:
        """Whether a run is what a store's pages usually are: distinct keys, none resident or
        refused, each the parent of the next."""
        if len(keys_and_parents) < 2:
            return False
        keys = [key for key, _ in keys_and_parents]
        return ([parent for _, parent in keys_and_parents[1:]] == keys[:-1]
                and self._key_to_page.keys().isdisjoint(keys)
                and self._refused.keys().isdisjoint(keys) and len(set(keys)) == len(keys))

    def _insert_new_chain(self, chain: Sequence[tuple[Key, Key | None]]) -> None:
        """`on_insert_many` of a new chain (`_is_new_chain`), as it would insert it: each page
        after the first continues the chain its parent started (one touch time, one deeper),
        covered by its child until the last, which alone is filed."""
        self._admitting = False
        self._forget_pending_many(key for key, _ in chain)
        tree, reference = self._tree, self.history.reference
        span = self._bucket_span
        first_key, first_parent = chain[0]
        if first_parent is None:
            depth = 0
        elif (parent_page := self._key_to_page.get(first_parent)) is not None:
            depth = parent_page.depth + 1
        else:
            parent_depth = self.history.depth(first_parent)
            depth = 0 if parent_depth is None else parent_depth + 1
        time = tree.tick(first_key, first_parent)
        continue_chain = tree.continue_chain
        last = len(chain) - 1
        for index, (key, parent) in enumerate(chain):
            page = _Page(time, reference(key, time, depth), parent, depth)
            is_leaf = continue_chain(key, page) if index else tree.add_covered(key, page)
            if index == last:
                if is_leaf:
                    self._file_leaf(key, page)
            elif is_leaf:  # covered by the next page: what filing then unfiling leaves
                self._note_bucket((page.page_class, time // span))
            depth += 1
        self._num_refs_since_table += len(chain)

    def on_access(self, key: Key) -> None:
        """Count a use of a resident `key`; unknown keys are ignored."""
        self._admitting = False
        page = self._key_to_page.get(key)
        if page is None:
            return
        was_leaf = page.filing
        if was_leaf:
            self._unfile(page)
        self._num_refs_since_table += 1
        page.time = self._tree.tick(key, page.parent)
        page.page_class = self.history.reference(key, page.time, page.depth)
        if was_leaf:
            self._file_leaf(key, page)  # filed again under its new class and time

    def on_access_many(self, keys: Sequence[Key]) -> None:
        """`on_access` each key in turn (one recall's hits), without a call per key."""
        self._admitting = False
        key_to_page, tick, reference = self._key_to_page, self._tree.tick, self.history.reference
        num_hits = 0
        for key in keys:
            page = key_to_page.get(key)
            if page is None:
                continue
            num_hits += 1
            was_leaf = page.filing
            if was_leaf:
                self._unfile(page)
            page.time = time = tick(key, page.parent)
            page.page_class = reference(key, time, page.depth)
            if was_leaf:
                self._file_leaf(key, page)
        self._num_refs_since_table += num_hits  # read by `choose_victim` only

    def on_remove(self, key: Key) -> None:
        """Forget `key`, history included; unknown keys are ignored."""
        self._admitting = False
        self.history.forget(key)
        self._forget_pending(key)
        if key in self._key_to_page:
            self._tree.remove(key)

    def evict(self, key: Key) -> None:
        """Evict a resident leaf `key` that another order chose (the adaptive policy's): unlike
        `on_remove`, the history keeps it, so its return is measured and its children refused.
        """
        self._admitting = False
        self._tree.remove(key)

    def end_admissions(self) -> None:
        """The current run of `admit` calls is over (the caller makes room now): the next
        `admit` starts a new run, abandoning what this one admitted and did not insert."""
        self._admitting = False

    def is_pending_parent(self, key: Key) -> bool:
        """Whether `key` is the parent of an admitted page not stored yet (not a victim)."""
        return key in self._parent_to_num_pending

    @property
    def tree(self) -> PrefixTree[_Page]:
        """The resident pages as a prefix tree, read only (the adaptive policy's leaf orders
        take its shape when it follows one of them)."""
        return self._tree

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Evict and return the leaf of least hit density that `can_evict` accepts.

        Pinned leaves and parents of pages being stored keep their place. Returns None when no
        resident leaf may be evicted.
        """
        return first_victim(self.victims(can_evict))

    def victims(self, can_evict: CanEvict) -> Victims:
        """`choose_victim` one leaf after another, from where the last one was found: the
        table and heap are brought up to date once, and the leaves `can_evict` refuses are
        set aside until the caller closes it (they would be refused again: nothing references
        a page meanwhile)."""
        self._admitting = False
        if self._num_refs_since_table >= self.capacity_pages:
            self._num_refs_since_table = 0
            self._densities = self.history.hit_densities()
            self._heap_epoch = -1
        if self._heap_epoch != self._tree.clock // self._bucket_span:
            self._rebuild_heap()
        heap, pending = self._bucket_heap, self._parent_to_num_pending
        is_current, remove = self._is_current, self._tree.remove
        skipped: list[tuple[tuple[int, int], _Leaf]] = []
        try:
            while heap:
                _, time_bucket, page_class = heap[0]
                bucket = (page_class, time_bucket)
                buckets = self._bucket_to_leaves  # rebound when empty buckets are dropped
                leaves = buckets.get(bucket)
                if not leaves:
                    heapq.heappop(heap)
                    buckets.pop(bucket, None)
                    continue
                leaf = heapq.heappop(leaves)
                if not is_current(leaf):
                    continue
                key = leaf[2]
                if key in pending or not can_evict(key):
                    skipped.append((bucket, leaf))
                    continue
                remove(key)  # its parent may become a leaf: filed in the same heap
                yield key
        finally:
            for bucket, leaf in skipped:
                self._push_leaf(bucket, leaf)

    def _file_leaf(self, key: Key, page: _Page) -> None:
        self._num_filings += 1
        page.filing = self._num_filings
        bucket = (page.page_class, page.time // self._bucket_span)
        num_leaves = self._bucket_to_num_leaves.get(bucket, 0) + 1
        self._bucket_to_num_leaves[bucket] = num_leaves
        leaf = (page.time, -self._num_filings, key)
        leaves = self._bucket_to_leaves.get(bucket)
        later = self._filing_later
        if leaves is None:  # rare: the first leaf of a class in this span
            if len(self._bucket_to_leaves) > 2 * len(self._bucket_to_num_leaves) + 64:
                self._drop_empty_buckets()
            if later is None:
                self._push_leaf(bucket, leaf)
                return
            self._add_bucket(bucket)  # now, as unbatched filing would: its density is now's
        if later is not None:
            later.append((bucket, leaf))
            return
        assert leaves is not None
        heapq.heappush(leaves, leaf)
        if len(leaves) > 2 * num_leaves + 8:  # mostly stale: keep the current leaves only
            leaves[:] = [entry for entry in leaves if self._is_current(entry)]
            heapq.heapify(leaves)

    def _note_bucket(self, bucket: tuple[int, int]) -> None:
        """What filing a leaf in `bucket` and unfiling it at once would leave behind: the bucket
        added if new, with today's density (as `_file_leaf` inside `on_insert_many` does)."""
        if bucket in self._bucket_to_leaves:
            return
        num_buckets = len(self._bucket_to_num_leaves) + (bucket not in self._bucket_to_num_leaves)
        if len(self._bucket_to_leaves) > 2 * num_buckets + 64:
            self._drop_empty_buckets()
        self._add_bucket(bucket)

    def _unfile(self, page: _Page) -> None:
        # The page's filing goes stale. An emptied bucket stays for now: the next page of the
        # same request often refills it at once.
        page.filing = 0
        bucket = (page.page_class, page.time // self._bucket_span)
        num_leaves = self._bucket_to_num_leaves[bucket] - 1
        if num_leaves:
            self._bucket_to_num_leaves[bucket] = num_leaves
        else:
            del self._bucket_to_num_leaves[bucket]

    def _drop_empty_buckets(self) -> None:
        # Their heap entries are dropped when met.
        self._bucket_to_leaves = {bucket: leaves
                                  for bucket, leaves in self._bucket_to_leaves.items()
                                  if bucket in self._bucket_to_num_leaves}

    def _is_current(self, leaf: _Leaf) -> bool:
        page = self._key_to_page.get(leaf[2])
        return page is not None and page.filing == -leaf[1]

    def _push_leaf(self, bucket: tuple[int, int], leaf: _Leaf) -> None:
        leaves = self._bucket_to_leaves.get(bucket)
        if leaves is None:
            leaves = self._add_bucket(bucket)
        heapq.heappush(leaves, leaf)

    def _add_bucket(self, bucket: tuple[int, int]) -> list[_Leaf]:
        leaves: list[_Leaf] = []
        self._bucket_to_leaves[bucket] = leaves
        if self._heap_epoch >= 0:  # a heap being used gets the new bucket now
            heapq.heappush(self._bucket_heap, self._heap_entry(bucket))
        return leaves

    def _heap_entry(self, bucket: tuple[int, int]) -> tuple[float, int, int]:
        page_class, time_bucket = bucket
        age = self._tree.clock - time_bucket * self._bucket_span  # the bucket's oldest possible
        return (self._densities[page_class][self.history.age_bin(age)], time_bucket, page_class)

    def _rebuild_heap(self) -> None:
        self._heap_epoch = self._tree.clock // self._bucket_span
        self._drop_empty_buckets()
        # `_heap_entry` of each bucket, inline: a rebuild per span touches every bucket.
        clock, span, densities = self._tree.clock, self._bucket_span, self._densities
        age_bin = self.history.age_bin
        self._bucket_heap = [
            (densities[page_class][age_bin(clock - time_bucket * span)], time_bucket, page_class)
            for page_class, time_bucket in self._bucket_to_leaves]
        heapq.heapify(self._bucket_heap)

    def _refuse(self, key: Key) -> None:
        self._refused[key] = None
        if len(self._refused) > self.capacity_pages:
            self._refused.popitem(last=False)

    def _forget_pending_many(self, keys: Iterable[Key]) -> None:
        """`_forget_pending` of each key (a run being inserted), without a call per key."""
        pending, num_pending = self._pending_to_parent, self._parent_to_num_pending
        for key in keys:
            admitted_under = pending.pop(key, _NOT_PENDING)
            if admitted_under is not None and admitted_under is not _NOT_PENDING:
                siblings = num_pending[admitted_under] - 1
                if siblings:
                    num_pending[admitted_under] = siblings
                else:
                    del num_pending[admitted_under]

    def _forget_pending(self, key: Key) -> None:
        if key not in self._pending_to_parent:
            return
        parent = self._pending_to_parent.pop(key)
        if parent is not None:
            self._forget_pending_parent(parent)

    def _forget_pending_parent(self, parent: Key) -> None:
        num_pending = self._parent_to_num_pending[parent] - 1
        if num_pending:
            self._parent_to_num_pending[parent] = num_pending
        else:
            del self._parent_to_num_pending[parent]

    def shrink(self) -> int:
        """Shrink its own tables, its tree's and its history's; drop the buckets left empty
        (kept for a refill that a large delete makes unlikely) and the heap over them, rebuilt
        at the next victim. Each empty bucket is a list made in the middle of some store: the
        interpreter cannot give back the memory of a store's page objects while one lives."""
        self._drop_empty_buckets()
        self._bucket_heap = []
        self._heap_epoch = -1
        return (super().shrink() + shrink_attributes(self._tree)
                + shrink_attributes(self.history))

    def __len__(self) -> int:
        return len(self._key_to_page)

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_page
