"""Reuse statistics of one tier's traffic, and the hit density they give each class of page.

`ReuseHistory` remembers the last reference of recently referenced keys, resident or not (a
ghost history many times the tier's capacity: ~100 bytes a key against a page of hundreds of
KiB or more), and measures, per class of page, how long pages took to come back:

- a page's class is its use count (up to MAX_USES) and the octave of its depth in its prefix
  chain (up to MAX_DEPTH_OCTAVE): pages used more come back more often, and the deep pages of
  long requests less often than shallow ones (in the Mooncake conversation trace a new page
  that is a request's 2nd or 3rd comes back 36% of the time, its 128th or later 19%);
- distances are counted in age bins spaced BINS_PER_OCTAVE to a doubling, up to the horizon;
  a page that left the history without coming back counts as never coming back.

`hit_densities()` turns the histograms into a table: for a page of class c that has gone `a`
without coming back, the most hits per slot and unit of time it can still offer,

    density(c, a) = max over horizons m > a of
                    P(return in (a, m]) * (1 + H(c'))
                    / (E[slot time from a until min(return, m)] + P(return in (a, m]) * T(c'))

where c' is the class the page enters when it comes back (one use more) and H(c'), T(c') are
the hits and slot time a page of c' yields from then on, kept to its own best horizon (solved
from the most used class down; that class leads to itself and is solved as a fixed point). A
return is worth more than one hit when it leads to more: a page used a few times is kept for
the hits of the whole run it is likely in, not just the next one; a page whose return leads
only to a sparser class is counted as dropped at its return (on the Mooncake conversation
trace this took the block hit ratio from 10.14% to 10.39% at 1% capacity, 22.55% to 22.76% at
5%). Without the continuation terms this is the hit density of LHD (Beckmann et al., NSDI'18),
measured on the ghost history rather than on the tier's own hits, so that a tier too small to
keep a page until its return still learns that it would have returned. The best horizon
rather than a fixed one, because a page whose returns come late is worth something only if it
is kept long enough: in conversation traffic few pages come back soon after a turn (the user
reads and types), so a page that has waited may be worth more than a fresh one, which no
recency order can express. Nothing is fitted to a trace: before any evidence every class gets
the same density and the order is recency; a class with little evidence leans on the class
with one use fewer (a prior of one page). Counts halve each time as many new keys as the
history holds have been seen, so the table follows a change in traffic.

Verbs: `reference` records a use, `forget` drops a key, `hit_densities` builds the table,
`age_bin` places an age in it.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import numpy as np

from kvtier.policies.base import Key

# Use counts are told apart up to this many; more count as this many.
MAX_USES = 8
# Depths are told apart by octave (0, 1, 2-3, 4-7, ...) up to this one (depth 32 and more).
MAX_DEPTH_OCTAVE = 6
# Age bins: four to a doubling resolve the shape of return times without starving bins.
BINS_PER_OCTAVE = 4
# Pseudo-count of the prior: a class's histogram starts as one page of its prior's.
PRIOR_PAGES = 1.0


def page_class(uses: int, depth: int) -> int:
    """The class of a page with `uses` references at `depth` in its prefix chain (0: first)."""
    return min(uses, MAX_USES) * (MAX_DEPTH_OCTAVE + 1) + min(depth.bit_length(),
                                                               MAX_DEPTH_OCTAVE)


# A reference packed in an int: time above three fields of _FIELD_BITS (class, uses, depth
# from the lowest bit up). Uses and depth saturate at _FIELD_MASK, far past where a class
# stops telling them apart (MAX_USES, 2 ** MAX_DEPTH_OCTAVE).
_FIELD_BITS = 24
_FIELD_MASK = (1 << _FIELD_BITS) - 1
_DEPTH_SHIFT = 2 * _FIELD_BITS
_TIME_SHIFT = 3 * _FIELD_BITS


def _unpack(last: int) -> tuple[int, int, int, int]:
    """(time, page class, uses, depth) of a packed reference."""
    return (last >> _TIME_SHIFT, last & _FIELD_MASK, last >> _FIELD_BITS & _FIELD_MASK,
            last >> _DEPTH_SHIFT & _FIELD_MASK)


class ReuseHistory:
    """The last reference of up to `capacity_keys` keys, oldest dropped first, and per-class
    histograms of return distances up to `horizon` (in the caller's clock units).

    A class is a use count and a shape: `num_shapes` classes per use count, `shape()` picks
    one (the depth octave). A subclass may refine the shape; the bench that measures how much
    a better prediction would be worth (bench/bench_policy_headroom.py) adds an oracle's bit.
    """

    num_shapes = MAX_DEPTH_OCTAVE + 1

    def __init__(self, capacity_keys: int, horizon: int) -> None:
        self.capacity_keys = capacity_keys
        self.num_classes = (MAX_USES + 1) * self.num_shapes
        edges = [0]
        octave_step = 0
        while edges[-1] < horizon:
            octave_step += 1
            edge = int(2 ** (octave_step / BINS_PER_OCTAVE)) - 1
            if edge > edges[-1]:
                edges.append(edge)
        self._edges = edges  # bin b holds ages in [edges[b], edges[b + 1])
        self.num_bins = len(edges) - 1
        self._widths = np.diff(np.array(edges, dtype=np.float64))
        # (age bin a, end bin m) of every horizon m > a, by a; where each a's pairs start.
        ages, ends = np.triu_indices(self.num_bins, 1, self.num_bins + 1)
        self._age_end_pairs = (ages, ends)
        self._age_starts = np.searchsorted(ages, np.arange(self.num_bins))
        # Each key's last reference, packed in one int (`_unpack`): a tuple per reference kept
        # the garbage collector busy while the history grows (a tuple is tracked, an int is not).
        self._key_to_last: OrderedDict[Key, int] = OrderedDict()
        # Plain lists: one increment per reference is cheaper there than in numpy arrays.
        self._returns = [[0.0] * self.num_bins for _ in range(self.num_classes)]
        self._entered = [0.0] * self.num_classes  # references that put a page in each class
        self._num_new_since_decay = 0
        self._shapes_by_depth = type(self).shape is ReuseHistory.shape  # `shape` inline

    def reference(self, key: Key, time: int, depth: int) -> int:
        """Record a reference of `key` at `time`, `depth` deep in its chain; return its class."""
        last = self._key_to_last.pop(key, None)
        if last is None:
            uses = 1
            self._num_new_since_decay += 1
            if self._num_new_since_decay > self.capacity_keys:
                self._decay()
        else:  # `_unpack`, inline
            last_class = last & _FIELD_MASK
            uses = (last >> _FIELD_BITS & _FIELD_MASK) + 1
            distance = time - (last >> _TIME_SHIFT)
            edges = self._edges
            if distance < edges[-1]:  # `age_bin`, inline: below the last edge
                self._returns[last_class][bisect.bisect_right(edges, distance) - 1] += 1
        if self._shapes_by_depth:
            octave = depth.bit_length()
            shape = octave if octave < MAX_DEPTH_OCTAVE else MAX_DEPTH_OCTAVE
        else:
            shape = self.shape(key, depth)
        cls = (uses if uses < MAX_USES else MAX_USES) * self.num_shapes + shape
        self._entered[cls] += 1
        self._key_to_last[key] = (
            time << _TIME_SHIFT | (depth if depth < _FIELD_MASK else _FIELD_MASK) << _DEPTH_SHIFT
            | (uses if uses < _FIELD_MASK else _FIELD_MASK) << _FIELD_BITS | cls)
        if len(self._key_to_last) > self.capacity_keys:
            self._key_to_last.popitem(last=False)
        return cls

    def shape(self, key: Key, depth: int) -> int:
        """The class of `key` among those of its use count: the octave of its `depth`."""
        return min(depth.bit_length(), MAX_DEPTH_OCTAVE)

    def uses(self, key: Key) -> int:
        """References of `key` the history remembers; 0 for a key it does not know."""
        last = self._key_to_last.get(key)
        return 0 if last is None else _unpack(last)[2]

    def depth(self, key: Key) -> int | None:
        """Depth of `key` at its last reference; None for a key the history does not know."""
        last = self._key_to_last.get(key)
        return None if last is None else _unpack(last)[3]

    def forget(self, key: Key) -> None:
        """Drop `key`'s record; unknown keys are ignored."""
        self._key_to_last.pop(key, None)

    def age_bin(self, age: int) -> int:
        """The bin of the density table that holds `age` (the last bin holds all older)."""
        return min(bisect.bisect_right(self._edges, age) - 1, self.num_bins - 1)

    def hit_densities(self) -> list[list[float]]:
        """The density table: `table[page_class][age_bin]`, hits per slot per clock unit."""
        observed_returns = np.array(self._returns)
        observed_entered = np.array(self._entered)
        pooled_entered = observed_entered.sum()
        if pooled_entered < 1:  # no evidence yet: one density for all, so recency decides
            return [[1.0] * self.num_bins for _ in range(self.num_classes)]
        # A class with little evidence leans on the class with one use fewer, same shape (a
        # page used more is no less likely to come back), the first on all classes pooled.
        returns = observed_returns
        entered = observed_entered + PRIOR_PAGES
        shapes = self.num_shapes
        prior = np.broadcast_to(observed_returns.sum(axis=0) / pooled_entered,
                                (shapes, self.num_bins))
        for uses in range(1, MAX_USES + 1):
            classes = slice(uses * shapes, (uses + 1) * shapes)
            returns[classes] += PRIOR_PAGES * prior
            prior = returns[classes] / entered[classes, None]
        # waiting[c, b]: pages of class c not yet back at the start of bin b (b = 0..num_bins)
        came_back = np.concatenate((np.zeros((self.num_classes, 1)), np.cumsum(returns, axis=1)),
                                   axis=1)
        waiting = np.maximum(entered[:, None] - came_back, 1e-9)
        # slot_time[c, b]: slot time the class's pages spend waiting in bins before b
        slot_time = np.concatenate((np.zeros((self.num_classes, 1)),
                                    np.cumsum(waiting[:, :-1] * self._widths, axis=1)), axis=1)
        later_hits, later_time = self._continuations(waiting, slot_time)
        # For a page at age bin a, evicted at the start of bin m > a: every such pair at once,
        # flat, a's pairs side by side (the pairs with m <= a, half the square, are skipped).
        ages, ends = self._age_end_pairs
        hits = waiting[:, ages] - waiting[:, ends]
        occupancy = slot_time[:, ends] - slot_time[:, ages]
        with np.errstate(divide="ignore", invalid="ignore"):
            # Keeping the page past its return only when that pays: else it goes at its return.
            kept = hits * later_time[:, None]
            kept += occupancy
            np.divide(hits * (1 + later_hits[:, None]), kept, out=kept)
            density = np.divide(hits, occupancy, out=hits)
            np.maximum(density, kept, out=density)
        return np.maximum.reduceat(density, self._age_starts, axis=1).tolist()

    def _continuations(self, waiting: np.ndarray, slot_time: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Per class, the hits and slot time a page yields after its next return: those of a
        fresh page of the class one use up, kept to its best horizon, and so on up."""
        shapes = self.num_shapes
        hits_from_zero = waiting[:, :1] - waiting[:, 1:]  # returned by the end of bin m - 1
        time_from_zero = slot_time[:, 1:]
        entered = waiting[:, 0]
        yield_hits = np.zeros(self.num_classes)  # per fresh page of a class, all returns counted
        yield_time = np.zeros(self.num_classes)

        def solve(classes: slice, next_hits: np.ndarray, next_time: np.ndarray) -> None:
            # The best horizon, each with the better of dropping or keeping a returned page.
            hits, time = hits_from_zero[classes], time_from_zero[classes]
            value = hits * (1 + next_hits[:, None])
            cost = time + hits * next_time[:, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                keep = value / cost > hits / time
                value, cost = np.where(keep, value, hits), np.where(keep, cost, time)
                best = np.nan_to_num(value / cost, nan=-1.0).argmax(axis=1)
            rows = np.arange(best.size)
            yield_hits[classes] = value[rows, best] / entered[classes]
            yield_time[classes] = cost[rows, best] / entered[classes]

        # The most used class leads to itself: with p, t the return probability and slot time
        # per page up to a horizon, H = p (1 + H) and T = t + p T, so H = p / (1 - p) and
        # T = t / (1 - p), whose ratio is p / t: LHD's best horizon is its best.
        top = slice(MAX_USES * shapes, (MAX_USES + 1) * shapes)
        solve(top, np.zeros(shapes), np.zeros(shapes))
        returning = np.minimum(yield_hits[top], 1 - 1e-6)
        yield_hits[top] = returning / (1 - returning)
        yield_time[top] /= 1 - returning
        for uses in range(MAX_USES - 1, 0, -1):
            up = slice((uses + 1) * shapes, (uses + 2) * shapes)
            solve(slice(uses * shapes, (uses + 1) * shapes), yield_hits[up], yield_time[up])
        # A page of class c comes back into class c' (one use more, same shape).
        next_class = np.array([min(cls // shapes + 1, MAX_USES) * shapes + cls % shapes
                               for cls in range(self.num_classes)])
        return yield_hits[next_class], yield_time[next_class]

    def _decay(self) -> None:
        self._num_new_since_decay = 0
        self._returns = [[count / 2 for count in row] for row in self._returns]
        self._entered = [count / 2 for count in self._entered]

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_last

    def __len__(self) -> int:
        return len(self._key_to_last)
