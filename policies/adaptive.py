"""Adaptive prefix eviction: leaves of the prefix tree leave first, in whichever of three orders
has been winning lately on this tier's own traffic.

Traces differ in what predicts a page's return. In conversation traffic pages come back late
(the user reads and types), and the measured hit density of the prefix policy keeps a page that
has waited; where shared prompts and documents are read again and again, a page's use count
does best (frequency); where conversations come back once or twice and move on, how recently
and how often together (recency). No fixed order wins everywhere, and a constant tuned to one
trace loses on the next, so this policy runs all three and follows the one that would have hit
most lately:

- `Expert.DENSITY`: the prefix policy's order (`kvtier.policies.prefix`): least measured hit
  density first;
- `Expert.FREQUENCY`, `Expert.RECENCY`: the two orders of `kvtier.policies.leaf_order`
  (GreedyDual-Frequency; LRFU with a half-life of one capacity of references).

The tier keeps every page's scores in all three and files its leaves in the order it follows, over
one prefix tree, the density's: while it follows density the leaf orders' scores are kept without a
tree or heap (`LeafScores`), and a switch to a leaf order files the leaves once under the density
tree's shape (`LeafOrder.adopt`). One shadow cache per order, metadata only, sees the tier's
references and evicts by its own order alone; each counts its hits, every hit decaying by half over
SCORE_HALF_LIFE_CAPACITIES capacities of references (what won lately, not since start). Above
SHADOW_PAGES the shadows see a hash-sampled share of the keys and hold that share of the capacity.
When the tier needs room it follows the order whose shadow leads, once the lead is significant
(SWITCH_SIGMAS): each switch disturbs what the tier holds. On the first half of the Mooncake
conversation trace at 5% (fractions of OPT), density alone hits 0.473; following leads of two
standard deviations 0.456, of three 0.478. (Whole shadows and counts kept for evicted pages,
following every lead: 0.606 on the whole trace, below density alone, 0.622, and frequency alone,
0.616.) No constant is fitted to a trace (the orders, the window and the significance are
structural; the two choices above were made on that half) and the traffic makes the choice (set
dueling, as in DIP, Qureshi et al., ISCA'07, with shadow caches rather than sets: chains of pages do
not split into sets).

What it costs a store (`bench/bench_policy_cost.py`: a metadata-only store of 8192 pages, each
stored page evicting one): 4.4-4.8 us per stored page beyond LRU on a two-core machine where
LRU's own is 7.3-8.8 (5.6-6.1 before a store's victims came from one pass and the history's
records became ints; 12.7-18.8 before the shadows were sampled to 512 pages:
docs/design-notes.md).
The shadows now see one key in 16 at that capacity and cost about 2.5 us a stored page (timed
around `tidy`); the rest is the density order itself (its history, tree and buckets).
The shadow work waits: under the store's lock a sampled reference is only queued, and `tidy`,
which the store and the recall call after releasing it, feeds the queue to the shadows. A
decision made before that (a caller that never calls `tidy`) feeds them first, so every
decision sees what it would have seen had the shadows been fed at once. A store with bytes
does all of it for a big wave while the wave is copied (`kvtier.store.filing`): there, host
stores of 64 KiB pages run at 0.88-0.92 of `np.copyto` (`bench/bench_tiers.py`; 0.72-0.78
with the bookkeeping after the copy).

Every order evicts leaves only, so the pages that remain always form whole prefixes; admission is
the prefix policy's (a key whose parent is known to be gone is refused, and the parent of an
admitted page still being stored is never a victim).

Verbs: `admit` (`admit_many`) checks a key's parent, `on_insert` (`on_insert_many`: a store's
run) and `on_access` (`on_access_many`: a recall's hits) reference a key, `on_remove` forgets
it, `choose_victim` (`victims`: one after another) evicts the first leaf of the winning order
the caller lets go, `tidy` feeds the shadows off the caller's lock.
"""

from __future__ import annotations

import enum
import math
import threading
import zlib
from collections import deque
from collections.abc import Sequence

from kvtier.dict_room import shrink_attributes
from kvtier.policies.base import CanEvict, EvictionPolicy, Key, Victims, first_victim
from kvtier.policies.leaf_order import LeafOrder, LeafScores, Order
from kvtier.policies.prefix import PrefixPolicy


class Expert(enum.IntEnum):
    """An order the adaptive policy may follow."""

    DENSITY = 0  # the prefix policy's measured hit density
    FREQUENCY = 1  # GreedyDual-Frequency
    RECENCY = 2  # LRFU


# Shadows model at least this many pages: above it they see a sample of the keys (by a hash of
# the key) and hold the same share of the capacity, which estimates each order's hit ratio at a
# fraction of the cost (spatial sampling, as SHARDS, Waldspurger et al., FAST'15, does for miss
# ratio curves). A sparser sample shows fewer hits per window: its scores' window is longer in
# step (SCORE_HALF_LIFE_CAPACITIES), so a lead is as significant as before. Against 2048 pages
# and a window of one capacity, the trace family's geometric mean went from 0.7489 to 0.7492 of
# OPT, and a store's shadow work at 8192 pages to a quarter (512 with the one-capacity window:
# 0.7475, a lead no longer significant where a leaf order wins).
SHADOW_PAGES = 512

# A shadow hit's weight halves over this many capacities of references: long enough that the
# sampled shadows count as many hits per window as whole ones would over one capacity.
SCORE_HALF_LIFE_CAPACITIES = 4.0

# Sampled references queued for the shadows before they are fed inline (a caller that never
# calls `tidy`): what waits stays bounded.
MAX_QUEUED_REFERENCES = 4096

# The order followed changes only when another shadow's lead is this many standard deviations of
# the difference of two counts of hits (Poisson: the square root of their sum): a lead within
# the noise of sampled shadows is no reason to reorder the tier.
SWITCH_SIGMAS = 3.0

_LEAF_ORDER_OF = {Expert.FREQUENCY: Order.FREQUENCY, Expert.RECENCY: Order.RECENCY}


def _always(key: Key) -> bool:
    return True


class AdaptivePolicy(EvictionPolicy):
    """Leaf-first eviction in the order whose shadow cache hits most lately."""

    name = "adaptive"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        # The tier: the same resident pages filed by density (which also admits) and by the
        # two leaf orders.
        self._density = PrefixPolicy(capacity_pages)
        self._density_pages = self._density.tree.key_to_page  # read only
        # The leaf orders' scores of the same pages. Following density, they are kept without a
        # tree (`LeafScores`); following a leaf order, a `LeafOrder` takes the density's tree's
        # shape and files the leaves in it (sharing the score records), until density again.
        self._leaf_scores = LeafScores(float(capacity_pages))
        self._leaves: LeafOrder | None = None
        shadow_pages = min(capacity_pages, SHADOW_PAGES)
        self._sample_below = (1 << 32) * shadow_pages // capacity_pages  # of a key's crc32
        self._shadow_pages = shadow_pages
        self._density_shadow = PrefixPolicy(shadow_pages)
        self._leaf_shadows = [(expert, order, LeafOrder(shadow_pages, (order,)))
                              for expert, order in _LEAF_ORDER_OF.items()]
        # Decayed shadow hits: score * 2^(-(clock - scored_at) / half_life) at `clock`.
        self._half_life = SCORE_HALF_LIFE_CAPACITIES * capacity_pages
        self._scores = [0.0 for _ in Expert]
        self._scored_at = [0 for _ in Expert]
        self._clock = 0
        self._decided_at = -1
        self.expert = Expert.DENSITY  # the order evictions follow now
        # (clock, key, parent) of sampled references the shadows have not seen: appended under
        # the caller's lock, fed to the shadows by `tidy` without it (a deque: an append and a
        # popleft are each atomic), or by the next decision if no `tidy` came first.
        self._queued: deque[tuple[int, Key, Key | None]] = deque()
        self._shadow_lock = threading.Lock()  # one feeder of the shadows at a time

    def admit(self, key: Key, parent: Key | None = None) -> bool:
        """Admit `key` unless its `parent` is known to be gone (see `PrefixPolicy.admit`)."""
        return self._density.admit(key, parent)

    def admit_many(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> list[bool]:
        """`admit` each (key, parent) in turn (a store's new pages): whether each may enter."""
        return self._density.admit_many(keys_and_parents)

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident under `parent`; a resident key counts as a hit."""
        page = self._density_pages.get(key)
        if page is not None:
            parent = page.parent
            if self._leaves is None:  # its record, before density moves its touch time
                self._leaf_scores.keep(key, parent, page.time)
        self._density.on_insert(key, parent)
        self._reference(key, parent)

    def on_insert_many(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> None:
        """`on_insert` one store's pages at once: each order files the run's leaves at its end,
        then the shadows see the run."""
        pages = self._density_pages
        resident = [key for key, _ in keys_and_parents if key in pages]  # mostly none
        # A resident key keeps the parent it was inserted under (a store has no repeated key).
        run = keys_and_parents if not resident else [
            (key, pages[key].parent) if key in pages else (key, parent)
            for key, parent in keys_and_parents]
        if self._leaves is not None:
            resident = []
        for key in resident:  # their records, before density moves their touch times
            self._leaf_scores.keep(key, pages[key].parent, pages[key].time)
        self._density.on_insert_many(run)
        if self._leaves is not None:
            self._leaves.reference_many(run)
        for key in resident:  # at the touch times density's tree gave them; new pages need
            self._leaf_scores.reference(key, pages[key].time)  # no record (`LeafScores`)
        self._queue_sampled(run)

    def on_access(self, key: Key) -> None:
        """Count a use of a resident `key`; unknown keys are ignored."""
        page = self._density_pages.get(key)
        if page is not None and self._leaves is None:  # before density moves its touch time
            self._leaf_scores.keep(key, page.parent, page.time)
        self._density.on_access(key)
        if page is not None:
            self._reference(key, page.parent)

    def on_access_many(self, keys: Sequence[Key]) -> None:
        """`on_access` each key in turn (one recall's hits): density counts the run in one
        call, then the leaf orders and the shadows see each hit."""
        pages = self._density_pages
        hits = [(key, page, page.time) for key in keys if (page := pages.get(key)) is not None]
        if len({key for key, _, _ in hits}) < len(hits):  # a key hit twice: each in turn
            for key in keys:
                self.on_access(key)
            return
        self._density.on_access_many(keys)  # moves each page's touch time
        leaves, scores = self._leaves, self._leaf_scores
        for key, page, last_time in hits:
            if leaves is not None:
                leaves.reference(key, page.parent)
            else:
                scores.hit(key, page.parent, last_time, page.time)
        self._queue_sampled([(key, page.parent) for key, page, _ in hits])

    def on_remove(self, key: Key) -> None:
        """Forget `key` (the shadows keep it: they model the orders, not this tier's moves)."""
        resident = key in self._density_pages
        self._density.on_remove(key)
        if not resident:
            return
        if self._leaves is not None:
            self._leaves.forget(key)
        else:
            self._leaf_scores.forget(key)

    def shrink(self) -> int:
        """Shrink the density order's tables, the leaf orders', and the shadows' (beside a
        `tidy`, which feeds them)."""
        given_back = self._density.shrink() + shrink_attributes(self._leaf_scores)
        if self._leaves is not None:
            given_back += self._leaves.shrink()
        with self._shadow_lock:
            given_back += self._density_shadow.shrink()
            given_back += sum(shadow.shrink() for _, _, shadow in self._leaf_shadows)
        return given_back

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Evict and return the first leaf of the winning order that `can_evict` accepts.

        Pinned leaves and parents of pages being stored keep their place. Returns None when no
        resident leaf may be evicted.
        """
        return first_victim(self.victims(can_evict))

    def victims(self, can_evict: CanEvict) -> Victims:
        """`choose_victim` one leaf after another: the order to follow is chosen once (no
        reference comes between two victims)."""
        if self._decided_at != self._clock:  # once per reference: a store evicts in runs
            self._decided_at = self._clock
            with self._shadow_lock:  # waits for a `tidy` under way: the scores read whole
                self._feed_queued()  # no `tidy` since: the shadows catch up first
                best = max(Expert, key=self._score)
                lead = self._score(best) - self._score(self.expert)
                if lead > SWITCH_SIGMAS * math.sqrt(self._score(best) + self._score(self.expert)):
                    self.expert = best
        density = self._density
        if self.expert is Expert.DENSITY:
            if self._leaves is not None:  # back to density: the leaf orders keep scores only
                self._leaf_scores = self._leaves.scores()
                self._leaves = None
            forget = self._leaf_scores.forget
            by_density = density.victims(can_evict)
            try:
                for victim in by_density:
                    forget(victim)
                    yield victim
            finally:
                by_density.close()
            return
        order = _LEAF_ORDER_OF[self.expert]
        if self._leaves is None:  # O(pages), once per switch
            self._leaf_scores.complete(self._density_pages)
            self._leaves = LeafOrder.adopt(self.capacity_pages, order, self._leaf_scores,
                                           density.tree)
        else:
            self._leaves.set_orders((order,))
        density.end_admissions()
        leaves = self._leaves
        may_leave = lambda k: not density.is_pending_parent(k) and can_evict(k)  # noqa: E731
        while (victim := leaves.evict_leaf(order, may_leave)) is not None:
            density.evict(victim)
            yield victim

    def tidy(self) -> None:
        """Feed the queued references to the shadows. Safe without the caller's lock, beside
        the other methods: it touches the shadows and their scores only."""
        if self._queued:
            with self._shadow_lock:
                self._feed_queued()

    def shadow_scores(self) -> dict[Expert, float]:
        """Each order's decayed shadow hits as of now, for the references fed to the shadows."""
        return {expert: self._score(expert) for expert in Expert}

    def _feed_queued(self) -> None:
        """Feed the queue to the shadows; the caller holds `_shadow_lock`."""
        queued = self._queued
        while queued:
            clock, key, parent = queued.popleft()
            self._shadow_reference(clock, key, parent)

    def _is_sampled(self, key: Key) -> bool:
        if self._sample_below >> 32:
            return True
        data = key if isinstance(key, bytes) else repr(key).encode()
        return zlib.crc32(data) < self._sample_below

    def _reference(self, key: Key, parent: Key | None) -> None:
        if self._leaves is not None:
            self._leaves.reference(key, parent)
        else:
            self._leaf_scores.reference(key, self._density_pages[key].time)
        self._queue_sampled(((key, parent),))

    def _queue_sampled(self, run: Sequence[tuple[Key, Key | None]]) -> None:
        """Tick the clock for each (key, parent) of `run`, queueing the sampled references for
        the shadows (fed by `tidy`, or inline once MAX_QUEUED_REFERENCES wait)."""
        clock, sample_all, below = self._clock, self._sample_below >> 32, self._sample_below
        queued = self._queued
        for key, parent in run:
            clock += 1
            if sample_all or zlib.crc32(  # `_is_sampled`, inline
                    key if isinstance(key, bytes) else repr(key).encode()) < below:
                queued.append((clock, key, parent))
        self._clock = clock
        if len(queued) >= MAX_QUEUED_REFERENCES:
            self.tidy()

    def _shadow_reference(self, clock: int, key: Key, parent: Key | None) -> None:
        """Show the shadows a reference of a sampled `key` under `parent` at `clock`."""
        if parent is not None and not self._is_sampled(parent):
            parent = None  # the shadows hold sampled keys only: a chain is cut where one is not
        shadow = self._density_shadow
        if key in shadow:
            self._count_hit(Expert.DENSITY, clock)
            shadow.on_access(key)
        else:
            while len(shadow) >= self._shadow_pages:
                if shadow.choose_victim(_always) is None:
                    break
            shadow.on_insert(key, parent)
        for expert, order, leaf_shadow in self._leaf_shadows:
            if key in leaf_shadow:
                self._count_hit(expert, clock)
            else:
                while len(leaf_shadow) >= self._shadow_pages:
                    if leaf_shadow.evict_leaf(order, _always) is None:
                        break
            leaf_shadow.reference(key, parent)

    def _count_hit(self, expert: Expert, clock: int) -> None:
        self._scores[expert] = self._score(expert, clock) + 1.0
        self._scored_at[expert] = clock

    def _score(self, expert: Expert, clock: int | None = None) -> float:
        """`expert`'s decayed shadow hits at `clock` (default: now)."""
        age = (self._clock if clock is None else clock) - self._scored_at[expert]
        score = self._scores[expert]
        return score * 2.0 ** (-age / self._half_life) if age else score

    def __len__(self) -> int:
        return len(self._density_pages)

    def __contains__(self, key: object) -> bool:
        return key in self._density_pages
