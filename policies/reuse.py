"""Reuse statistics of one tier's traffic, measured from a bounded history of references.

`ReuseHistory` remembers the last reference (clock and use count) of recently referenced keys,
resident or not, and from the references it sees measures two things a policy can rank pages
by, whatever the trace:

- `reuse_probability(uses)`: of the keys that reached `uses` references, the share that came
  back for one more (Laplace-smoothed, so 1/2 before any evidence);
- `mean_reuse_distance()`: the mean clock distance between two references of a key.

Both are measured over the history's horizon and decay (halve) each time as many new keys have
been seen as the history holds, so they follow a change in traffic. A key costs ~100 bytes of
metadata against a page of hundreds of KiB or more, so a history many times the tier's capacity
is cheap; it must be long because reuse distances in conversation traffic are several times any
affordable capacity (a user thinks before the next turn).

Verbs: `reference` records a use, `forget` drops a key.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import Key

# Use counts are told apart up to this many; more count as this many.
MAX_USE_CLASS = 16


class ReuseHistory:
    """The last reference of up to `capacity_keys` keys, oldest dropped first."""

    def __init__(self, capacity_keys: int) -> None:
        self.capacity_keys = capacity_keys
        self._key_to_last: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # (clock, uses)
        # _num_reaching[k]: keys seen reaching k uses (k = MAX_USE_CLASS + 1 counts k and more).
        self._num_reaching = [0.0] * (MAX_USE_CLASS + 2)
        self._distance_sum = 0.0
        self._num_distances = 0.0
        self._num_new_since_decay = 0

    def reference(self, key: Key, clock: int) -> int:
        """Record a reference of `key` at `clock`; return its use count, this one included."""
        last = self._key_to_last.pop(key, None)
        if last is None:
            uses = 1
            self._num_new_since_decay += 1
            if self._num_new_since_decay > self.capacity_keys:
                self._decay()
        else:
            last_clock, uses = last[0], last[1] + 1
            self._distance_sum += clock - last_clock
            self._num_distances += 1
        self._num_reaching[min(uses, MAX_USE_CLASS + 1)] += 1
        self._key_to_last[key] = (clock, uses)
        if len(self._key_to_last) > self.capacity_keys:
            self._key_to_last.popitem(last=False)
        return uses

    def uses(self, key: Key) -> int:
        """References of `key` the history remembers; 0 for a key it does not know."""
        last = self._key_to_last.get(key)
        return 0 if last is None else last[1]

    def forget(self, key: Key) -> None:
        """Drop `key`'s record; unknown keys are ignored."""
        self._key_to_last.pop(key, None)

    def reuse_probability(self, uses: int) -> float:
        """Estimated probability that a key with `uses` references gets one more."""
        k = min(uses, MAX_USE_CLASS)
        reached = self._num_reaching[k]
        if k == MAX_USE_CLASS:  # the last class keeps its own returns
            reached += self._num_reaching[k + 1]
        return (self._num_reaching[k + 1] + 1) / (reached + 2)

    def mean_reuse_distance(self, default: float) -> float:
        """Mean clock distance between two references of a key, at least 1; `default` before
        any reuse."""
        if not self._num_distances:
            return default
        return max(1.0, self._distance_sum / self._num_distances)

    def _decay(self) -> None:
        self._num_new_since_decay = 0
        self._num_reaching = [n / 2 for n in self._num_reaching]
        self._distance_sum /= 2
        self._num_distances /= 2

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_last

    def __len__(self) -> int:
        return len(self._key_to_last)
