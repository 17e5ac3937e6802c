"""A tier's prefix tree with its leaves filed in priority orders: the part of the adaptive policy
that both the real tier and its shadow caches share.

A page is useless once a page before it in its prefix is gone, so only leaves of the prefix tree
(pages with no resident child) may leave. Each resident page carries two scores, updated on every
reference, and the leaves are filed in one heap per order the caller asks for:

- `Order.FREQUENCY`: GreedyDual-Frequency (Cherkasova, HPL-98-69) with unit size and cost: a
  page's priority is the tier's inflation value L at its last reference plus its use count, and
  L rises to each victim's priority, so counts earned long ago age out instead of pinning a page
  forever (plain LFU's flaw). Ties go to the older page, then the deeper one.
- `Order.RECENCY`: LRFU (Lee et al., IEEE ToC 2001): the combined recency and frequency
  CRF = sum over the page's references of 2^(-age / half-life). CRF of two pages compares the
  same at any later time, so a page is filed under log2(CRF at its last reference) + its last
  reference time / half-life and the heap never needs reordering. The half-life is one capacity
  of references: a page used once falls behind a page used twice within about a tier's turnover.

A page that leaves is forgotten, as in both papers: it comes back with one use. (Keeping the
counts of evicted pages, a ghost of 16 capacities, made the frequency order stronger on its own
but the adaptive policy worse on the Mooncake conversation trace, 0.607 of OPT at 5% against
0.622: its shadow won more often, and each switch disturbs the tier.)

The tree and its clock are `policies/prefix_tree.py`'s: the pages one request touches along one
chain share a touch time, and ties go deepest first (a request's tail leaves before its head).
Heaps drop entries lazily: an entry is current while its page is resident, a leaf and filed
under the same filing number; a heap mostly stale is rebuilt.

Verbs: `reference` (insert or hit), `evict_leaf`, `forget`, `is_leaf`; `scores` hands the scores
to a `LeafScores`, which keeps them without a tree while a tier follows another order, and
`adopt` files them again under that tier's tree.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.dict_room import shrink_attributes
from kvtier.policies.base import Key
from kvtier.policies.prefix_tree import PrefixTree


class Order(enum.IntEnum):
    """An order of the leaves: which one leaves first."""

    FREQUENCY = 0  # GreedyDual-Frequency: use count over an aging floor
    RECENCY = 1  # LRFU: exponentially decayed use count


_NO_PAGE = ((None, None),)  # what follows a run's last page
_Entry = tuple[float, int, int, Key]  # (priority, touch time, -filing number, key)


@dataclass(slots=True)
class _Page:
    """A resident page: its place in the tree, its scores, and its current leaf filing."""

    parent: Key | None
    time: int  # the tick of the last reference (its chain's start)
    uses: int  # GreedyDual-Frequency's count
    frequency_priority: float  # L at the last reference + uses
    log_crf: float  # log2 of LRFU's CRF at `time`
    filing: int = 0  # the current filing while a leaf; 0: not filed


class LeafScores:
    """Both orders' scores of a tier's resident pages without their tree or heaps: what a tier
    that follows another order (the adaptive policy's density) keeps, so that `LeafOrder.adopt`
    files its leaves in a leaf order the moment it switches to one.

    A page referenced once since it became resident has no record here: its scores are a new
    page's (one use, L + 1, log CRF 0) at the touch time and under the parent its owner keeps
    for it. Most of a store's pages are new and most leave unreferenced again, so they cost
    nothing here. The owner calls `keep` before it changes such a page's touch time (a second
    reference), and `complete` before the records are filed (a switch to a leaf order); L does
    not move meanwhile (only a frequency victim raises it)."""

    def __init__(self, half_life: float, inflation: float = 0.0,
                 key_to_page: dict[Key, _Page] | None = None) -> None:
        self.half_life = half_life
        self.inflation = inflation
        self.key_to_page: dict[Key, _Page] = {} if key_to_page is None else key_to_page

    def keep(self, key: Key, parent: Key | None, time: int) -> None:
        """Give a resident `key` a record of its own if it has none: a new page's at `time`
        (its owner's touch time, before the owner moves it), under `parent`."""
        if key not in self.key_to_page:
            self.key_to_page[key] = _Page(parent, time, 1, self.inflation + 1, 0.0)

    def complete(self, owner_pages: dict[Key, Any]) -> None:
        """Give every page of `owner_pages` (the owner's records, with `parent` and `time`) a
        record of its own: what `LeafOrder.adopt` files."""
        key_to_page, new_priority = self.key_to_page, self.inflation + 1
        for key, owner_page in owner_pages.items():
            if key not in key_to_page:
                key_to_page[key] = _Page(owner_page.parent, owner_page.time, 1, new_priority,
                                         0.0)

    def reference(self, key: Key, time: int) -> None:
        """Score another reference of a resident `key` at touch `time` (a first one needs no
        call), as `LeafOrder.reference` does. A key without a record is a new page: kept
        implicit."""
        page = self.key_to_page.get(key)
        if page is None:
            return
        page.uses += 1
        page.frequency_priority = self.inflation + page.uses
        decay = (time - page.time) / self.half_life
        page.log_crf = math.log2(1.0 + 2.0 ** (page.log_crf - decay))
        page.time = time

    def hit(self, key: Key, parent: Key | None, last_time: int, time: int) -> None:
        """`keep` (at `last_time`, the owner's touch time before this hit) then `reference` at
        `time`, in one step: a recall's hits."""
        page = self.key_to_page.get(key)
        if page is not None:
            self.reference(key, time)
            return
        decay = (time - last_time) / self.half_life
        self.key_to_page[key] = _Page(parent, time, 2, self.inflation + 2,
                                      math.log2(1.0 + 2.0 ** -decay))

    def forget(self, key: Key) -> None:
        """Drop a resident `key`."""
        self.key_to_page.pop(key, None)


class LeafOrder:
    """Resident pages of one tier (real or shadow) as a prefix tree, leaves filed by `orders`."""

    def __init__(self, capacity_pages: int, orders: tuple[Order, ...],
                 half_life: float | None = None, ghost_pages: int = 0) -> None:
        self.capacity_pages = capacity_pages
        self._orders = orders
        # LRFU's half-life in references (default: one capacity).
        self._half_life = float(capacity_pages) if half_life is None else half_life
        self._inflation = 0.0  # GreedyDual's L: the priority of the last frequency victim
        self._tree: PrefixTree[_Page] = PrefixTree(self._file, self._unfile)
        self._key_to_page = self._tree.key_to_page  # read only, without a lookup per use
        self._num_leaves = 0
        self._num_filings = 0
        self._heaps: list[list[_Entry]] = [[] for _ in Order]
        # Use counts of the last `ghost_pages` evicted pages: one that returns keeps them.
        self._ghost_pages = ghost_pages
        self._ghost_uses: OrderedDict[Key, int] = OrderedDict()
        # Inside `reference_many`: leaves filed at its end, (key, page, filing number).
        self._filing_later: list[tuple[Key, _Page, int]] | None = None

    @classmethod
    def adopt(cls, capacity_pages: int, order: Order, scores: LeafScores,
              tree: PrefixTree[Any]) -> LeafOrder:
        """The pages `scores` holds, shaped as `tree`, leaves filed in `order`. `tree` is the
        owner's tree of the same resident pages, built by the same references, so its filing
        numbers order leaves as this order's own would: the later filed first on a tie."""
        leaves = cls(capacity_pages, (), scores.half_life)
        leaves._inflation = scores.inflation
        key_to_page = scores.key_to_page
        num_leaves = num_filings = 0
        for key, owner_page in tree.key_to_page.items():
            filing = key_to_page[key].filing = owner_page.filing
            if filing:
                num_leaves += 1
                num_filings = max(num_filings, filing)
        leaves._tree = tree.clone(leaves._file, leaves._unfile, key_to_page)
        leaves._key_to_page = key_to_page
        leaves._num_leaves, leaves._num_filings = num_leaves, num_filings
        leaves.set_orders((order,))
        return leaves

    def scores(self) -> LeafScores:
        """The pages' scores, for the owner to keep on its own: this order is dropped."""
        return LeafScores(self._half_life, self._inflation, self._key_to_page)

    def reference(self, key: Key, parent: Key | None) -> bool:
        """Insert `key` under `parent`, or count a use of it if resident; return whether it was.

        The caller makes room first: this never evicts.
        """
        time = self._tree.tick(key, parent)
        page = self._key_to_page.get(key)
        if page is not None:
            if page.filing:
                self._unfile(page)
            page.uses += 1
            page.frequency_priority = self._inflation + page.uses
            decay = (time - page.time) / self._half_life
            page.log_crf = math.log2(1.0 + 2.0 ** (page.log_crf - decay))
            page.time = time
            if not self._tree.has_children(key):
                self._file(key, page)
            return True
        uses = 1 + self._ghost_uses.pop(key, 0) if self._ghost_uses else 1
        self._tree.add(key, _Page(parent, time, uses, self._inflation + uses, 0.0))
        return False

    def reference_many(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> None:
        """`reference` each (key, parent) in turn; leaves go into the heaps at the end. A
        request's new pages form a chain: each one is a leaf only until the next arrives, so
        filing them one by one would push heap entries that are stale at once."""
        later: list[tuple[Key, _Page, int]] = []
        self._filing_later = later
        tree, key_to_page, ghost_uses = self._tree, self._key_to_page, self._ghost_uses
        inflation = self._inflation  # evictions raise it, and none happens here
        following = itertools.chain(itertools.islice(keys_and_parents, 1, None), _NO_PAGE)
        try:
            for (key, parent), (next_key, next_parent) in zip(keys_and_parents, following):
                if key in key_to_page:
                    self.reference(key, parent)
                    continue
                # `reference`'s insert, inline: most of a store's pages are new
                uses = 1 + ghost_uses.pop(key, 0) if ghost_uses else 1
                page = _Page(parent, tree.tick(key, parent), uses, inflation + uses, 0.0)
                if next_parent != key or next_key in key_to_page:
                    tree.add(key, page)
                else:  # its child comes next: a leaf until then, not filed
                    tree.add_covered(key, page)
        finally:
            self._filing_later = None
        for key, page, filing in later:
            if page.filing == filing and key_to_page.get(key) is page:  # still a filed leaf
                for order in self._orders:
                    heapq.heappush(self._heaps[order], self._entry(order, key, page))
        self._compact_heaps()

    def evict_leaf(self, order: Order, can_evict: Callable[[Key], bool]) -> Key | None:
        """Forget and return the first leaf in `order` that `can_evict` accepts, or None."""
        heap = self._heaps[order]
        skipped: list[_Entry] = []
        victim = None
        key_to_page = self._key_to_page
        while heap:
            entry = heapq.heappop(heap)
            page = key_to_page.get(entry[3])
            if page is None or page.filing != -entry[2]:  # stale (`_is_current`, inline)
                continue
            if not can_evict(entry[3]):
                skipped.append(entry)
                continue
            victim = entry[3]
            if order is Order.FREQUENCY:
                self._inflation = max(self._inflation, entry[0])
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if victim is not None:
            page = self._tree.remove(victim)
            if self._ghost_pages:
                self._ghost_uses[victim] = page.uses
                if len(self._ghost_uses) > self._ghost_pages:
                    self._ghost_uses.popitem(last=False)
        return victim

    def forget(self, key: Key) -> None:
        """Drop a resident `key`; its parent becomes a leaf if this was its last child."""
        self._tree.remove(key)

    def set_orders(self, orders: tuple[Order, ...]) -> None:
        """File the leaves in `orders` from now on (the others' heaps are dropped): a tier
        that follows one order at a time pays for one heap, and O(leaves) at each change."""
        if orders == self._orders:
            return
        self._orders = orders
        self._heaps = [[] for _ in Order]
        for order in orders:
            heap = self._heaps[order]
            heap[:] = [self._entry(order, key, page)
                       for key, page in self._key_to_page.items() if page.filing]
            heapq.heapify(heap)

    def is_leaf(self, key: Key) -> bool:
        """Whether `key` is resident with no resident child."""
        return self._tree.is_leaf(key)

    def parent_of(self, key: Key) -> Key | None:
        """The parent a resident `key` was inserted under."""
        return self._key_to_page[key].parent

    def num_filed(self) -> int:
        """Heap entries, current and stale, over all orders (bounded: see `_file`)."""
        return sum(len(self._heaps[order]) for order in self._orders)

    def num_leaves(self) -> int:
        """Resident pages with no resident child."""
        return self._num_leaves

    def _file(self, key: Key, page: _Page) -> None:
        self._num_filings += 1
        self._num_leaves += 1
        filing = page.filing = self._num_filings
        later = self._filing_later
        if later is not None:
            later.append((key, page, filing))
            return
        for order in self._orders:
            heap = self._heaps[order]
            if order is Order.FREQUENCY:  # `_entry`, inline: a filing per reference
                heapq.heappush(heap, (page.frequency_priority, page.time, -filing, key))
            else:
                heapq.heappush(heap, (page.log_crf + page.time / self._half_life, page.time,
                                      -filing, key))
            if len(heap) > 2 * self._num_leaves + 64:
                self._compact_heaps()

    def _compact_heaps(self) -> None:
        for order in self._orders:
            heap = self._heaps[order]
            if len(heap) > 2 * self._num_leaves + 64:  # mostly stale: keep current entries
                heap[:] = [entry for entry in heap if self._is_current(entry)]
                heapq.heapify(heap)

    def _entry(self, order: Order, key: Key, page: _Page) -> _Entry:
        if order is Order.FREQUENCY:
            return (page.frequency_priority, page.time, -page.filing, key)
        return (page.log_crf + page.time / self._half_life, page.time, -page.filing, key)

    def _unfile(self, page: _Page) -> None:
        page.filing = 0
        self._num_leaves -= 1

    def shrink(self) -> int:
        """Rebuild the tables that lost most of their keys; the bytes given back."""
        return shrink_attributes(self) + shrink_attributes(self._tree)

    def _is_current(self, entry: _Entry) -> bool:
        page = self._key_to_page.get(entry[3])
        return page is not None and page.filing == -entry[2]

    def __len__(self) -> int:
        return len(self._key_to_page)

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_page
