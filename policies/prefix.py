"""Prefix-aware eviction: leaves of the prefix tree leave first, reuse earns time, ghosts remember.

A page is useless once any page before it in its prefix is gone, so this policy never evicts a
page while a child of it (the next page of some prefix) is resident in the tier: victims are
always leaves of the tier's prefix tree, and the pages that remain always form whole prefixes.

Among the leaves, the one with the lowest priority leaves first:

    priority = chain_time + credit * (min(uses, MAX_CREDITED_USES) - 1)

- `chain_time` is the tier's clock (pages inserted so far) when the request touching the page
  began: the pages one request touches in prefix order share it, and ties go deepest page first.
  A request's pages therefore age together, and its tail goes before its head.
- `uses` counts the page's references, including those before an eviction (the ghost list keeps
  them), so a page of a conversation that keeps coming back earns more time than a page seen once
  (about three quarters of pages are never reused; the more a page was used, the likelier it is
  to be used again).
- `credit` is what one use is worth, in the clock's units: the running median of the reuse
  distances the policy observes (pages inserted between two references of a key). It is
  measured, not fitted: a use buys one typical wait for the next use, whatever the trace. It
  starts at the capacity (what LRU would grant) and moves by 1/64 of itself per observation.

Ghosts: evicted keys are remembered (uses and last reference) for `GHOST_FACTOR` times the
capacity. A key costs ~100 bytes of metadata against a page of hundreds of KiB or more, and reuse
distances in conversation traffic are several times any affordable capacity (a user thinks
before the next turn), so a long memory is what lets a returning page be recognized.

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
from collections import OrderedDict

from kvtier.policies.base import CanEvict, EvictionPolicy, Key

# Ghost memory in multiples of the capacity: metadata only, see the module docstring.
GHOST_FACTOR = 4
# Past this many uses a page earns no more credit, so a page that was hot long ago ages out.
MAX_CREDITED_USES = 16
# The median estimate moves by 1/MEDIAN_STEP_DIVISOR of itself per observation: slow enough to
# be stable over one cache lifetime, fast enough to follow a shift in traffic.
MEDIAN_STEP_DIVISOR = 64

_Priority = tuple[float, int]  # (time, -touch sequence): deeper pages of one chain go first


class PrefixPolicy(EvictionPolicy):
    """Leaf-first eviction by chain recency plus credit per use, with a ghost list."""

    name = "prefix"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        self.ghost_capacity_keys = GHOST_FACTOR * capacity_pages
        self.credit = float(capacity_pages)
        self._clock = 0  # pages inserted: the unit of reuse distances
        self._num_touches = 0
        self._key_to_priority: dict[Key, _Priority] = {}
        self._key_to_uses: dict[Key, int] = {}
        self._key_to_last_clock: dict[Key, int] = {}
        self._key_to_parent: dict[Key, Key | None] = {}
        # Children resident in this tier, counted for any parent, resident or not: on disk a
        # child often arrives before its parent (the host demotes leaves first).
        self._key_to_num_children: dict[Key, int] = {}
        # Leaves by priority; stale entries (re-prioritized, evicted, or no longer leaves) are
        # skipped when popped: a heap cannot remove from the middle.
        self._leaves: list[tuple[_Priority, int, Key]] = []
        self._ghosts: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # key -> (uses, clock)
        # Admitted keys not yet inserted, with their parents: the parents may not be evicted
        # meanwhile. The store admits a run of keys, makes room, then inserts them: an admitted
        # key not inserted by the next run's first `admit` was abandoned (its store failed),
        # so it counts as refused from then on.
        self._pending_to_parent: dict[Key, Key | None] = {}
        self._parent_to_num_pending: dict[Key, int] = {}
        self._admitting = False  # inside a run of `admit` calls
        self._refused: OrderedDict[Key, None] = OrderedDict()  # bounded like the ghosts
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
                and (parent in self._ghosts or parent in self._refused)):
            self._refuse(key)
            return False
        self._refused.pop(key, None)
        self._forget_pending(key)
        self._pending_to_parent[key] = parent
        if parent is not None:
            self._parent_to_num_pending[parent] = self._parent_to_num_pending.get(parent, 0) + 1
        return True

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident under `parent`; a ghost key gets its past uses back."""
        self._admitting = False
        self._forget_pending(key)
        self._refused.pop(key, None)
        if key in self._key_to_priority:
            self.on_access(key)
            return
        self._clock += 1
        uses, last_clock = self._ghosts.pop(key, (0, None))
        self._observe_reuse(last_clock)
        self._key_to_uses[key] = uses + 1
        self._key_to_parent[key] = parent
        if parent is not None:
            self._key_to_num_children[parent] = self._key_to_num_children.get(parent, 0) + 1
        self._touch(key)

    def on_access(self, key: Key) -> None:
        """Count a use of a resident `key`; unknown keys are ignored."""
        self._admitting = False
        if key not in self._key_to_priority:
            return
        self._observe_reuse(self._key_to_last_clock[key])
        self._key_to_uses[key] += 1
        self._touch(key)

    def on_remove(self, key: Key) -> None:
        """Forget `key`, leaving no ghost; unknown keys are ignored."""
        self._admitting = False
        self._ghosts.pop(key, None)
        self._forget_pending(key)
        if key in self._key_to_priority:
            self._forget(key)

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Evict and return the lowest-priority leaf `can_evict` accepts; it becomes a ghost.

        Pinned leaves and parents of pages being stored keep their place. Returns None when no
        resident leaf may be evicted.
        """
        self._admitting = False
        skipped = []
        victim = None
        while self._leaves:
            item = heapq.heappop(self._leaves)
            priority, _, key = item
            if self._key_to_priority.get(key) != priority or self._key_to_num_children.get(key):
                continue  # stale: touched since, evicted, or a parent now
            if key in self._parent_to_num_pending or not can_evict(key):
                skipped.append(item)
                continue
            victim = key
            break
        for item in skipped:
            heapq.heappush(self._leaves, item)
        if victim is not None:
            self._ghosts[victim] = (self._key_to_uses[victim], self._key_to_last_clock[victim])
            if len(self._ghosts) > self.ghost_capacity_keys:
                self._ghosts.popitem(last=False)
            self._forget(victim)
        return victim

    def _touch(self, key: Key) -> None:
        self._num_touches += 1
        parent = self._key_to_parent[key]
        if parent is None or parent != self._last_key:
            self._chain_clock = self._clock  # a new chain starts: a new request
        self._last_key = key
        self._key_to_last_clock[key] = self._clock
        credited_uses = min(self._key_to_uses[key], MAX_CREDITED_USES) - 1
        priority = (self._chain_clock + self.credit * credited_uses, -self._num_touches)
        self._key_to_priority[key] = priority
        if not self._key_to_num_children.get(key):
            heapq.heappush(self._leaves, (priority, self._num_touches, key))

    def _observe_reuse(self, last_clock: int | None) -> None:
        # Frugal streaming median: one comparison per reuse, no sample kept.
        if last_clock is None:
            return
        step = max(1.0, self.credit / MEDIAN_STEP_DIVISOR)
        if self._clock - last_clock > self.credit:
            self.credit += step
        else:
            self.credit = max(1.0, self.credit - step)

    def _refuse(self, key: Key) -> None:
        self._refused[key] = None
        if len(self._refused) > self.ghost_capacity_keys:
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
        del self._key_to_last_clock[key]
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
        priority = self._key_to_priority.get(parent)
        if priority is not None:  # the parent is resident and a leaf again
            heapq.heappush(self._leaves, (priority, -priority[1], parent))

    def __len__(self) -> int:
        return len(self._key_to_priority)

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_priority
