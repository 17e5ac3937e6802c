"""Least-recently-used eviction: the key untouched for longest leaves first.

Verbs: `on_insert` and `on_access` make a key the most recent, `on_remove` forgets it,
`choose_victim` evicts the least recent key the caller lets go.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import CanEvict, EvictionPolicy, Key


class LruPolicy(EvictionPolicy):
    """Evicts the least recently inserted or accessed key, skipping keys the caller pins."""

    name = "lru"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        # Not a deque: a hit moves a key out of the middle, which OrderedDict does in O(1).
        # Order runs from least recent (front) to most recent (back).
        self._keys: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident and most recent; a resident key counts as a hit."""
        if key in self._keys:
            self.on_access(key)
            return
        self._keys[key] = None

    def on_access(self, key: Key) -> None:
        """Make a resident `key` the most recent; unknown keys are ignored."""
        if key in self._keys:
            self._keys.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        """Forget `key`; unknown keys are ignored."""
        self._keys.pop(key, None)

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Evict and return the least recent key `can_evict` accepts, or None if there is none.

        Pinned keys keep their place: being skipped is not a use.
        """
        for key in self._keys:
            if can_evict(key):
                # Safe despite iterating: we stop right after the deletion.
                del self._keys[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys
