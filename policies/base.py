"""The eviction policy interface every tier talks to.

A policy tracks the keys resident in one tier and decides two things: whether a new key may enter
(`admit`) and which resident key leaves when room is needed (`choose_victim`). The page table owns
the pages; a policy only orders keys. Keys are opaque hashable bytes.

Call protocol (driven by the store's placement, in `kvtier.store`, which owns the page table;
the policy tests drive a policy alone the same way, through `kvtier.testing.policies`):

- `on_miss(key)` once when a key that is not resident is about to be inserted, before any room is
  made (ARC adapts its target here);
- `admit(key, parent)` right after, with the key of the previous page of the same prefix (or
  None for a chain's first page): False keeps the key out of the tier. A policy may remember
  what it admitted until the key's `on_insert` (to keep the parent of a page being stored), but
  must not reorder or evict anything; `admit_many` makes both calls for one store's new pages;
- `choose_victim(can_evict)` as many times as room is needed; the policy forgets the key it returns;
  or `victims(can_evict)`, which yields them one by one (between two, the caller may `on_remove`
  other keys) and is closed when there is room;
- `on_insert(key, parent)` when the key becomes resident (`parent` is the key of the previous page
  of the same prefix, or None), or `on_insert_many` for one store's keys at once;
- `on_access(key)` on every hit, or `on_access_many(keys)` for one recall's hits in order;
- `on_remove(key)` when a resident key leaves for any reason other than eviction (delete, failed
  write, promotion out of the tier);
- `tidy()` after a store, without the caller's lock: work a policy could defer (shadow caches);
- `shrink()` under the caller's lock, now and then: give back the room of the keys it forgot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import ClassVar

from kvtier.dict_room import shrink_attributes

Key = Hashable
CanEvict = Callable[[Key], bool]
Victims = Generator[Key, None, None]  # a policy's victims, one by one (`victims`)


class EvictionPolicy(ABC):
    """Orders the keys of one tier for eviction. Not thread-safe: the caller holds its lock."""

    name: ClassVar[str]

    def __init__(self, capacity_pages: int) -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages must be at least 1, got {capacity_pages}")
        self.capacity_pages = capacity_pages

    def on_miss(self, key: Key) -> None:  # noqa: B027 - a hook most policies leave empty
        """A non-resident key is about to be inserted; adaptive policies learn from it."""

    def admit(self, key: Key, parent: Key | None = None) -> bool:
        """Return whether `key`, whose prefix's previous page is `parent`, may enter the tier.

        The default admits everything. An admitted key is inserted (`on_insert`) or abandoned
        (its store failed) before the caller's store returns.
        """
        return True

    def admit_many(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> list[bool]:
        """`on_miss` then `admit` each (key, parent) in turn: one store's new pages, in order.
        Returns whether each may enter. Policies that can decide a run at once override it."""
        admitted = []
        for key, parent in keys_and_parents:
            self.on_miss(key)
            admitted.append(self.admit(key, parent))
        return admitted

    def tidy(self) -> None:  # noqa: B027 - a hook most policies leave empty
        """Do deferred bookkeeping. Called without the caller's lock, possibly beside the other
        methods: a policy that overrides it keeps what it touches to itself."""

    @abstractmethod
    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """`key` is now resident."""

    def on_insert_many(self, keys_and_parents: Sequence[tuple[Key, Key | None]]) -> None:
        """`on_insert` each (key, parent) in turn: one store's pages, in order. Policies that
        can file a run at once override it."""
        for key, parent in keys_and_parents:
            self.on_insert(key, parent)

    def shrink(self) -> int:
        """Rebuild the tables that lost most of their keys (a large delete) at the size their
        keys need; the bytes given back. Policies made of parts shrink those too."""
        return shrink_attributes(self)

    @abstractmethod
    def on_access(self, key: Key) -> None:
        """`key` was hit while resident."""

    def on_access_many(self, keys: Sequence[Key]) -> None:
        """`on_access` each key in turn: one recall's hits, in order. Policies that can count a
        run at once override it."""
        for key in keys:
            self.on_access(key)

    @abstractmethod
    def on_remove(self, key: Key) -> None:
        """`key` left the tier by delete or move; forget it without treating it as an eviction."""

    @abstractmethod
    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Pick the next key to evict among those `can_evict` accepts, forget it, and return it.

        Returns None when no resident key can be evicted (all pinned or being written).
        """

    def victims(self, can_evict: CanEvict) -> Victims:
        """`choose_victim` again and again: a key is evicted (forgotten) when it is asked for,
        never ahead, and the caller closes the iterator once it has room. Between two keys it
        may `on_remove` others. Policies that can go on from where the last search stopped
        override it (a search past pinned keys, once per store rather than once per victim)."""
        while (victim := self.choose_victim(can_evict)) is not None:
            yield victim

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is resident."""


def first_victim(victims: Victims) -> Key | None:
    """The first key of a policy's `victims` (None if it has none), the iterator closed: a
    `choose_victim` for policies that override `victims`."""
    try:
        return next(victims, None)
    finally:
        victims.close()
