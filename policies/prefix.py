"""Prefix-aware eviction: leaves of the prefix tree leave first, by measured hit density.

A page is useless once any page before it in its prefix is gone, so this policy never evicts a
page while a child of it (the next page of some prefix) is resident in the tier: victims are
always leaves of the tier's prefix tree, and the pages that remain always form whole prefixes.

Among the leaves, the one with the lowest expected hit density leaves first:

    density = ln(reuse_probability(uses)) - (clock - chain_time) / mean_reuse_distance

- `chain_time` is the tier's clock (pages inserted so far) when the request touching the page
  began: the pages one request touches in prefix order share it, and ties go deepest page first.
  A request's pages therefore age together, and its tail goes before its head.
- `uses` counts the page's references, including those before an eviction (a long history of
  references remembers them, see `kvtier.policies.reuse`).
- `reuse_probability(uses)` is the measured share of pages with that many uses that came back
  once more (in the Mooncake conversation trace 24%, 42%, 50%, 58% for 1..4 uses; in traffic
  where uses tell nothing it is flat, and the policy orders by recency alone, like LRU).
- `mean_reuse_distance` is the measured mean clock distance between two uses of a page.

Why this form: if a page that will come back does so after an exponentially distributed wait of
mean D, its expected hits per slot and unit of time are p * exp(-age / D) / D, whose logarithm
is the density above (less ln D, the same for all). Within one use class the oldest leaf has
the least, so each class keeps its leaves in a heap by age and only the classes' oldest leaves
are compared, with the estimates of the moment. Nothing is fitted to a trace: p and D are
measured, and before any evidence (p = 1/2 for every class) the order is recency.

Admission keeps the tier's prefixes whole: `admit(key, parent)` refuses a key whose parent is
known to be gone from the tier (evicted, or itself refused) and is not being stored alongside it,
and a resident page that is the parent of an admitted page still being stored is never a victim.
A parent the tier never saw is no reason to refuse: on disk a demoted child arrives before its
parent, which is still in the host tier.

Verbs: `admit` checks a key's parent, `on_insert` and `on_access` reference a key, `on_remove`
forgets it, `choose_victim` evicts the lowest-priority leaf the caller lets go.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from kvtier.policies.base import CanEvict, EvictionPolicy, Key
from kvtier.policies.reuse import MAX_USE_CLASS, ReuseHistory

# History of references in multiples of the capacity: metadata only (see policies/reuse.py).
# It must span typical reuse distances; a quarter of this loses most returns at small capacities.
HISTORY_FACTOR = 16

_Priority = tuple[float, int]  # (time, -touch sequence): deeper pages of one chain go first


class PrefixPolicy(EvictionPolicy):
    """Leaf-first eviction of the page least likely to be hit soon, from measured reuse."""

    name = "prefix"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        self.history = ReuseHistory(HISTORY_FACTOR * capacity_pages)
        self._clock = 0  # pages inserted: the unit of reuse distances
        self._num_touches = 0
        self._key_to_priority: dict[Key, _Priority] = {}
        self._key_to_uses: dict[Key, int] = {}  # capped at MAX_USE_CLASS: the page's class
        self._key_to_parent: dict[Key, Key | None] = {}
        # Children resident in this tier, counted for any parent, resident or not: on disk a
        # child often arrives before its parent (the host demotes leaves first).
        self._key_to_num_children: dict[Key, int] = {}
        # Leaves by class (use count), each class oldest first; stale entries (touched since,
        # evicted, or no longer leaves) are skipped when met: a heap cannot remove from the
        # middle. A class's worth is read when choosing, so a page's order never rests on
        # estimates from when it was last touched.
        self._class_to_leaves: list[list[tuple[_Priority, int, Key]]] = [
            [] for _ in range(MAX_USE_CLASS + 1)]
        # Admitted keys not yet inserted, with their parents: the parents may not be evicted
        # meanwhile. The store admits a run of keys, makes room, then inserts them: an admitted
        # key not inserted by the next run's first `admit` was abandoned (its store failed),
        # so it counts as refused from then on.
        self._pending_to_parent: dict[Key, Key | None] = {}
        self._parent_to_num_pending: dict[Key, int] = {}
        self._admitting = False  # inside a run of `admit` calls
        self._refused: OrderedDict[Key, None] = OrderedDict()  # bounded by the capacity
        self._last_key: Key | None = None
        self._chain_clock = 0

    def admit(self, key: Key, parent: Key | None = None) -> bool:
        """Admit `key` unless its `parent` is known to be gone from this tier; the parent of an
        admitted key is kept until the key is inserted or the next run of admissions starts."""
        if not self._admitting:
            self._admitting = True
            for abandoned in self._pending_to_parent:
                self._refuse(abandoned)
            self._pending_to_parent.clear()
            self._parent_to_num_pending.clear()
        if parent is not None and parent not in self._key_to_priority and (
                parent not in self._pending_to_parent
                and (parent in self.history or parent in self._refused)):
            self._refuse(key)
            return False
        self._refused.pop(key, None)
        self._forget_pending(key)
        self._pending_to_parent[key] = parent
        if parent is not None:
            self._parent_to_num_pending[parent] = self._parent_to_num_pending.get(parent, 0) + 1
        return True

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident under `parent`; a key the history knows keeps its past uses."""
        self._admitting = False
        self._forget_pending(key)
        self._refused.pop(key, None)
        if key in self._key_to_priority:
            self.on_access(key)
            return
        self._clock += 1
        self._key_to_uses[key] = min(self.history.reference(key, self._clock), MAX_USE_CLASS)
        self._key_to_parent[key] = parent
        if parent is not None:
            self._key_to_num_children[parent] = self._key_to_num_children.get(parent, 0) + 1
        self._touch(key)

    def on_access(self, key: Key) -> None:
        """Count a use of a resident `key`; unknown keys are ignored."""
        self._admitting = False
        if key not in self._key_to_priority:
            return
        self._key_to_uses[key] = min(self.history.reference(key, self._clock), MAX_USE_CLASS)
        self._touch(key)

    def on_remove(self, key: Key) -> None:
        """Forget `key`, history included; unknown keys are ignored."""
        self._admitting = False
        self.history.forget(key)
        self._forget_pending(key)
        if key in self._key_to_priority:
            self._forget(key)

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Evict and return the leaf of least hit density that `can_evict` accepts.

        Pinned leaves and parents of pages being stored keep their place. Returns None when no
        resident leaf may be evicted.
        """
        self._admitting = False
        skipped: list[tuple[int, tuple[_Priority, int, Key]]] = []
        victim = None
        mean_distance = self.history.mean_reuse_distance(default=self.capacity_pages)
        worths = [0.0] + [math.log(self.history.reuse_probability(uses))
                          for uses in range(1, MAX_USE_CLASS + 1)]
        while victim is None:
            # The oldest leaf of each class; the least worth left after aging goes.
            lowest, lowest_uses = math.inf, 0
            for uses in range(1, MAX_USE_CLASS + 1):
                leaves = self._class_to_leaves[uses]
                while leaves and self._is_stale(leaves[0], uses):
                    heapq.heappop(leaves)
                if leaves:
                    age = self._clock - leaves[0][0][0]
                    density = worths[uses] - age / mean_distance
                    if density < lowest:
                        lowest, lowest_uses = density, uses
            if not lowest_uses:
                break
            item = heapq.heappop(self._class_to_leaves[lowest_uses])
            key = item[2]
            if key in self._parent_to_num_pending or not can_evict(key):
                skipped.append((lowest_uses, item))
                continue
            victim = key
        for uses, item in skipped:
            heapq.heappush(self._class_to_leaves[uses], item)
        if victim is not None:
            self._forget(victim)
        return victim

    def _is_stale(self, item: tuple[_Priority, int, Key], uses: int) -> bool:
        priority, _, key = item
        return (self._key_to_priority.get(key) != priority or self._key_to_uses[key] != uses
                or bool(self._key_to_num_children.get(key)))

    def _touch(self, key: Key) -> None:
        self._num_touches += 1
        parent = self._key_to_parent[key]
        if parent is None or parent != self._last_key:
            self._chain_clock = self._clock  # a new chain starts: a new request
        self._last_key = key
        priority = (self._chain_clock, -self._num_touches)
        self._key_to_priority[key] = priority
        if not self._key_to_num_children.get(key):
            self._push_leaf(key)

    def _push_leaf(self, key: Key) -> None:
        priority = self._key_to_priority[key]
        heapq.heappush(self._class_to_leaves[self._key_to_uses[key]],
                       (priority, -priority[1], key))

    def _refuse(self, key: Key) -> None:
        self._refused[key] = None
        if len(self._refused) > self.capacity_pages:
            self._refused.popitem(last=False)

    def _forget_pending(self, key: Key) -> None:
        if key not in self._pending_to_parent:
            return
        parent = self._pending_to_parent.pop(key)
        if parent is None:
            return
        num_pending = self._parent_to_num_pending[parent] - 1
        if num_pending:
            self._parent_to_num_pending[parent] = num_pending
        else:
            del self._parent_to_num_pending[parent]

    def _forget(self, key: Key) -> None:
        del self._key_to_priority[key]
        del self._key_to_uses[key]
        parent = self._key_to_parent.pop(key)
        if self._last_key == key:
            self._last_key = None
        if parent is None:
            return
        num_children = self._key_to_num_children[parent] - 1
        if num_children:
            self._key_to_num_children[parent] = num_children
            return
        del self._key_to_num_children[parent]
        if parent in self._key_to_priority:  # the parent is resident and a leaf again
            self._push_leaf(parent)

    def __len__(self) -> int:
        return len(self._key_to_priority)

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_priority
