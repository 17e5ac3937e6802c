"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

Resident keys live in T1 (seen once recently) or T2 (seen at least twice). Ghost lists B1 and B2
remember keys recently evicted from T1 and T2; a miss on a ghost tells which list deserved more
room, and the target size p of T1 moves toward it. One-time scans thus churn T1 and leave T2 alone.

Verbs: `on_miss` adapts p, `on_insert` places a key in T1 or (after a ghost hit) T2, `on_access`
promotes to T2, `on_remove` forgets a key, `choose_victim` runs ARC's REPLACE.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import CanEvict, EvictionPolicy, Key

# Not deques: hits, ghost hits and removals take keys out of the middle, which OrderedDict does in
# O(1). Every list runs from least recent (front) to most recent (back).
_KeyList = OrderedDict[Key, None]


class ArcPolicy(EvictionPolicy):
    """ARC over `capacity_pages` resident keys plus up to as many ghost keys."""

    name = "arc"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        self._t1: _KeyList = OrderedDict()
        self._t2: _KeyList = OrderedDict()
        self._b1: _KeyList = OrderedDict()
        self._b2: _KeyList = OrderedDict()
        # A float, as in the paper: the step |B2|/|B1| need not be whole.
        self._target_t1_pages = 0.0
        # REPLACE breaks the |T1| == p tie toward T1 only while a B2 ghost waits to come back.
        self._pending_key: Key | None = None

    @property
    def target_t1_pages(self) -> float:
        """ARC's p: how many resident keys T1 should hold, in [0, capacity_pages]."""
        return self._target_t1_pages

    def on_miss(self, key: Key) -> None:
        """Grow p on a B1 ghost hit, shrink it on a B2 ghost hit; resident keys are ignored."""
        if key in self:
            return
        self._pending_key = key
        if key in self._b1:
            step = max(1.0, len(self._b2) / len(self._b1))
            self._target_t1_pages = min(float(self.capacity_pages), self._target_t1_pages + step)
        elif key in self._b2:
            step = max(1.0, len(self._b1) / len(self._b2))
            self._target_t1_pages = max(0.0, self._target_t1_pages - step)

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident: into T2 if it was a ghost, else T1. A resident key is a hit."""
        if key in self:
            self.on_access(key)
            return
        self._pending_key = None
        was_ghost = key in self._b1 or key in self._b2
        self._b1.pop(key, None)
        self._b2.pop(key, None)
        if was_ghost:
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def on_access(self, key: Key) -> None:
        """Move a resident `key` to T2's most recent end; unknown keys are ignored."""
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        """Forget `key` in every list, leaving no ghost; unknown keys are ignored."""
        for keys in (self._t1, self._t2, self._b1, self._b2):
            keys.pop(key, None)
        if self._pending_key == key:
            self._pending_key = None

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Run REPLACE: evict from T1 or T2 toward p, falling back to the other list when the
        preferred one holds only pinned keys. The victim becomes a ghost. None if all are pinned.
        """
        num_t1 = len(self._t1)
        pending_in_b2 = self._pending_key is not None and self._pending_key in self._b2
        prefer_t1 = num_t1 > 0 and (
            num_t1 > self._target_t1_pages
            or (pending_in_b2 and num_t1 == self._target_t1_pages)
        )
        if prefer_t1:
            order = ((self._t1, self._b1), (self._t2, self._b2))
        else:
            order = ((self._t2, self._b2), (self._t1, self._b1))
        for resident, ghosts in order:
            victim = _pop_first_evictable(resident, can_evict)
            if victim is not None:
                ghosts[victim] = None
                return victim
        return None

    def _trim_ghosts(self) -> None:
        # The paper's bounds: |T1| + |B1| <= c keeps B1 from outgrowing the recency side, and
        # the whole directory stays within 2c. B2 gives way first, as in the paper's case IV(b).
        capacity = self.capacity_pages
        while self._b1 and len(self._t1) + len(self._b1) > capacity:
            self._b1.popitem(last=False)
        while (self._b1 or self._b2) and len(self) + len(self._b1) + len(self._b2) > 2 * capacity:
            (self._b2 or self._b1).popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


def _pop_first_evictable(keys: _KeyList, can_evict: CanEvict) -> Key | None:
    # Pinned keys keep their place: being skipped is not a use.
    for key in keys:
        if can_evict(key):
            # Safe despite iterating: we stop right after the deletion.
            del keys[key]
            return key
    return None
