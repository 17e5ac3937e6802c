"""Least-recently-used eviction: the key untouched for longest leaves first, and of the pages one
request touched together, the deepest first.

A request touches its pages in prefix order, but it uses them all at once: which of them was
"last" is an accident of the loop. Plain per-reference LRU takes that order at face value and so
evicts a request's first page before its later ones, stranding the later ones (a page is useless
once a page before it in its prefix is gone). Here a run of touches that follows one prefix chain
(each key's parent is the key touched just before) is one use: the run is a group, groups leave
oldest first, and within a group the deepest page leaves first. A key touched under a resident
parent that is not the key touched just before (the chain resumes after other calls) brings its
resident ancestors into its group first. A parent is then never evicted while a child is
resident (unless pins make it so), so the pages left form whole prefixes. Keys touched without a
parent form groups of one: plain LRU.

Verbs: `on_insert` and `on_access` make a key the most recent, `on_remove` forgets it,
`choose_victim` (`victims`: one after another) evicts the least recent key the caller lets go.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import CanEvict, EvictionPolicy, Key, Victims, first_victim


class LruPolicy(EvictionPolicy):
    """Evicts the least recently used key (deepest first among keys used together), skipping
    keys the caller pins."""

    name = "lru"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        self._key_to_group: dict[Key, int] = {}  # resident keys: the group of their last touch
        self._key_to_parent: dict[Key, Key | None] = {}
        # Groups from least recent (front) to most recent (back), each its keys in touch order.
        # A touch leaves the key's old entry behind (stale: its group moved on); stale entries
        # are skipped when met and swept when they outnumber the keys.
        self._groups: OrderedDict[int, list[Key]] = OrderedDict()
        self._num_entries = 0
        self._num_groups = 0
        self._last_key: Key | None = None
        self._open_keys: list[Key] | None = None  # the newest group's list, while it exists

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident and most recent; a resident key counts as a hit."""
        parent = self._key_to_parent.setdefault(key, parent)
        self._touch(key, parent)

    def on_access(self, key: Key) -> None:
        """Make a resident `key` the most recent; unknown keys are ignored."""
        if key in self._key_to_group:
            self._touch(key, self._key_to_parent[key])

    def on_remove(self, key: Key) -> None:
        """Forget `key`; unknown keys are ignored."""
        if self._key_to_group.pop(key, None) is not None:
            del self._key_to_parent[key]

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Evict and return the least recent key `can_evict` accepts, or None if there is none.

        Pinned keys keep their place: being skipped is not a use.
        """
        return first_victim(self.victims(can_evict))

    def victims(self, can_evict: CanEvict) -> Victims:
        """`choose_victim` one key after another, each search going on from where the last
        one stopped (the keys refused before it would be refused again)."""
        key_to_group, key_to_parent = self._key_to_group, self._key_to_parent
        emptied: list[int] = []
        group = -1  # the group searched when closed (-1: none), and its keys
        keys: list[Key] = []
        try:
            for group, keys in self._groups.items():
                index = len(keys)
                while index:  # deepest first: usually the oldest group's last entry goes
                    index -= 1
                    key = keys[index]
                    if key_to_group.get(key) != group:  # stale
                        del keys[index]
                        self._num_entries -= 1
                    elif can_evict(key):
                        del keys[index]
                        self._num_entries -= 1
                        del key_to_group[key]
                        del key_to_parent[key]
                        yield key
                if not keys:
                    emptied.append(group)
        finally:
            if group >= 0 and not keys and group not in emptied:  # closed at its last key
                emptied.append(group)
            for group in emptied:  # not while the groups are iterated
                del self._groups[group]
                if group == self._num_groups:
                    self._open_keys = None

    def _touch(self, key: Key, parent: Key | None) -> None:
        if parent is None or parent != self._last_key:
            self._num_groups += 1  # a new use; otherwise the chain goes on in the open group
            self._open_keys = None
            if parent in self._key_to_group:
                # The chain goes on after other calls (a daemon's clients interleave: a request's
                # recall, another's store, then this request's store): its resident ancestors
                # join this use first, so none of them is older than the key.
                self._touch_ancestors(parent)
        self._append(key)

    def _touch_ancestors(self, parent: Key) -> None:
        chain: dict[Key, None] = {}  # ordered, and stops a cycle that bad parent keys can make
        ancestor: Key | None = parent
        while ancestor is not None and ancestor in self._key_to_group and ancestor not in chain:
            chain[ancestor] = None
            ancestor = self._key_to_parent[ancestor]
        for ancestor in reversed(chain):  # root first: the deepest leaves first
            self._append(ancestor)

    def _append(self, key: Key) -> None:
        if self._open_keys is None:
            self._open_keys = self._groups[self._num_groups] = []
        self._open_keys.append(key)
        self._key_to_group[key] = self._num_groups
        self._last_key = key
        self._num_entries += 1
        if self._num_entries > 2 * len(self._key_to_group) + 64:
            self._sweep_stale()

    def _sweep_stale(self) -> None:
        groups: OrderedDict[int, list[Key]] = OrderedDict()
        for group, keys in self._groups.items():
            current = [key for key in keys if self._key_to_group.get(key) == group]
            if current or group == self._num_groups:  # the open group may still grow
                groups[group] = current
        self._groups = groups
        self._open_keys = groups.get(self._num_groups)
        self._num_entries = sum(map(len, groups.values()))

    def __len__(self) -> int:
        return len(self._key_to_group)

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_group
