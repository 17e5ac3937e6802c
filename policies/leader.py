"""Follow-the-leader eviction: leaves of the prefix tree leave first, in whichever of two orders
would have hit most lately on this tier's own traffic.

The two orders are `kvtier.policies.leaf_order`'s: GreedyDual-Frequency with aging (pages used
often stay, counts earned long ago age out) and LRFU (recency and frequency together, decayed by
half every `LRFU_HALF_LIFE_CAPACITIES` of the tier's capacity in references). Each is judged by a
shadow cache: metadata only, it sees a hash-sampled share of the keys, holds the same share of
the capacity, and evicts by its own order alone. Every shadow hit scores one point, decaying by
half over `SCORE_HALF_LIFE_CAPACITIES` capacities of references (what wins lately, not since
start), and the tier follows whichever order scores more, with no margin: both orders are filed
at all times, so a switch costs nothing and a late switch costs hits.

What it costs the store: the tier files a page in two heaps per reference; the shadows see one
key in `capacity / SHADOW_PAGES` (spatial sampling, as SHARDS, Waldspurger et al., FAST'15,
does for miss ratio curves), and that work waits: the store's path under its lock only queues
a sampled reference; `tidy`, which the store calls after releasing its lock, feeds the queue to
the shadows and picks the order to follow. A queue nobody drains is drained inline once it
holds `MAX_QUEUED_REFERENCES`.

Admission is LRU's (everything is admitted): only leaves leave, so what remains forms whole
prefixes without refusing a key whose parent left.

Verbs: `on_insert` and `on_access` reference a key, `on_remove` forgets it, `choose_victim`
evicts the first leaf of the order followed, `tidy` does the deferred work.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from collections.abc import Sequence

from kvtier.policies.base import CanEvict, EvictionPolicy, Key
from kvtier.policies.leaf_order import LeafOrder, Order

# Shadows hold at most this many pages: above it they see a share of the keys (by a hash of the
# key) and hold that share of the capacity.
SHADOW_PAGES = 512
# A shadow hit's weight halves over this many capacities of references.
SCORE_HALF_LIFE_CAPACITIES = 5.0
# LRFU's half-life, in capacities of references.
LRFU_HALF_LIFE_CAPACITIES = 1.0
# Use counts kept for this many capacities of evicted pages (0: a page that returns starts over).
GHOST_CAPACITIES = 16.0
# Sampled references queued for the shadows before they are fed inline (a caller that never
# calls `tidy`).
MAX_QUEUED_REFERENCES = 4096

_ORDERS = (Order.FREQUENCY, Order.RECENCY)


def _always(key: Key) -> bool:
    return True


class LeaderPolicy(EvictionPolicy):
    """Leaf-first eviction in the order (GreedyDual-Frequency or LRFU) whose shadow leads."""

    name = "leader"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        lrfu_half_life = LRFU_HALF_LIFE_CAPACITIES * capacity_pages
        self.order = Order.RECENCY  # the order evictions follow now
        ghost = int(GHOST_CAPACITIES * capacity_pages)
        self._leaves = LeafOrder(capacity_pages, (self.order,), lrfu_half_life, ghost)
        self._filed_order = self.order
        shadow_pages = min(capacity_pages, SHADOW_PAGES)
        share = shadow_pages / capacity_pages
        self._sample_below = (1 << 32) * shadow_pages // capacity_pages  # of a key's crc32
        self._sample_all = shadow_pages == capacity_pages
        self._shadow_pages = shadow_pages
        # A shadow's clock counts the references it sees: its LRFU half-life shrinks with it.
        self._shadows = [LeafOrder(shadow_pages, (order,), lrfu_half_life * share,
                                   int(GHOST_CAPACITIES * shadow_pages))
                         for order in _ORDERS]
        self._score_half_life = SCORE_HALF_LIFE_CAPACITIES * capacity_pages
        # A switch refiles every leaf: deciding once per capacity of references keeps that
        # within one entry per reference, however often the lead changes hands.
        self._decision_interval = capacity_pages
        self._scores = [0.0 for _ in _ORDERS]
        self._scored_at = [0 for _ in _ORDERS]
        self._clock = 0  # the tier's references
        # (clock, key, parent) of sampled references not yet seen by the shadows. A deque:
        # appends under the store's lock and pops in `tidy` without it are each atomic.
        self._queued: deque[tuple[int, Key, Key | None]] = deque()
        self._tidy_lock = threading.Lock()
        self._decided_at = 0  # the clock when the order was last chosen

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident under `parent`; a resident key counts as a hit."""
        leaves = self._leaves
        if key in leaves:
            parent = leaves.parent_of(key)
        leaves.reference(key, parent)
        self._reference(key, parent)

    def on_insert_many(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> None:
        """`on_insert` one store's pages at once: the run's leaves are filed once, at its end."""
        self._leaves.reference_many(keys_and_parents)
        clock, queued, below = self._clock, self._queued, self._sample_below
        for key, parent in keys_and_parents:  # `_reference`, inline
            clock += 1
            if self._sample_all or zlib.crc32(
                    key if isinstance(key, bytes) else repr(key).encode()) < below:
                queued.append((clock, key, parent))
        self._clock = clock
        if len(queued) >= MAX_QUEUED_REFERENCES:
            self.tidy()

    def on_access(self, key: Key) -> None:
        """Count a use of a resident `key`; unknown keys are ignored."""
        leaves = self._leaves
        if key in leaves:
            parent = leaves.parent_of(key)
            leaves.reference(key, parent)
            self._reference(key, parent)

    def on_remove(self, key: Key) -> None:
        """Forget `key` (the shadows keep it: they model the orders, not this tier's moves)."""
        if key in self._leaves:
            self._leaves.forget(key)

    def shrink(self) -> int:
        """Shrink the leaf order's tables and the shadows' (beside a `tidy`, which feeds them)."""
        given_back = self._leaves.shrink()
        with self._tidy_lock:
            given_back += sum(shadow.shrink() for shadow in self._shadows)
        return given_back

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Evict and return the first leaf of the order followed that `can_evict` accepts.

        Pinned leaves keep their place. Returns None when no resident leaf may be evicted.
        """
        order = self.order
        if order is not self._filed_order:  # `tidy` switched: refile the leaves
            self._filed_order = order
            self._leaves.set_orders((order,))
        return self._leaves.evict_leaf(order, can_evict)

    def tidy(self) -> None:
        """Feed the queued references to the shadows and follow the order that scores more.

        Safe without the caller's lock, beside the other methods: it touches the shadows and
        scores only, and sets `order` in one assignment. Concurrent calls skip.
        """
        if not self._tidy_lock.acquire(blocking=False):
            return
        try:
            queued = self._queued
            while queued:
                clock, key, parent = queued.popleft()
                self._shadow_reference(clock, key, parent)
            clock = self._clock
            if clock - self._decided_at >= self._decision_interval:
                self._decided_at = clock
                frequency = self._score(Order.FREQUENCY, clock)
                recency = self._score(Order.RECENCY, clock)
                if frequency != recency:  # a tie keeps the order
                    self.order = Order.FREQUENCY if frequency > recency else Order.RECENCY
        finally:
            self._tidy_lock.release()

    def shadow_scores(self) -> dict[Order, float]:
        """Each order's decayed shadow hits, as of the references the shadows have seen."""
        return {order: self._score(order, self._clock) for order in _ORDERS}

    def _reference(self, key: Key, parent: Key | None) -> None:
        self._clock += 1
        if self._is_sampled(key):
            self._queued.append((self._clock, key, parent))
            if len(self._queued) >= MAX_QUEUED_REFERENCES:
                self.tidy()

    def _is_sampled(self, key: Key) -> bool:
        return self._sample_all or zlib.crc32(
            key if isinstance(key, bytes) else repr(key).encode()) < self._sample_below

    def _shadow_reference(self, clock: int, key: Key, parent: Key | None) -> None:
        if parent is not None and not self._is_sampled(parent):
            parent = None  # the shadows hold sampled keys only: a chain is cut where one is not
        for order, shadow in zip(_ORDERS, self._shadows):
            if key in shadow:
                self._scores[order] = self._score(order, clock) + 1.0
                self._scored_at[order] = clock
            else:
                while len(shadow) >= self._shadow_pages:
                    if shadow.evict_leaf(order, _always) is None:
                        break
            shadow.reference(key, parent)

    def _score(self, order: Order, clock: int) -> float:
        age = clock - self._scored_at[order]
        score = self._scores[order]
        return score * 2.0 ** (-age / self._score_half_life) if age > 0 else score

    def __len__(self) -> int:
        return len(self._leaves)

    def __contains__(self, key: object) -> bool:
        return key in self._leaves
