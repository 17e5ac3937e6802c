"""A tier's resident pages as a prefix tree: which pages are leaves, and the clock that leaf-first
orders age pages by. The prefix policy (`policies/prefix.py`) and the adaptive policy's leaf orders
(`policies/leaf_order.py`) both keep one; each files its leaves its own way.

A page is useless once a page before it in its prefix is gone, so only leaves of the tree (pages
with no resident child) may leave. Children are counted for any parent, resident or not: a child
may arrive before its parent (on disk the host demotes leaves first), and a resident parent
becomes a leaf again only when its last resident child leaves.

Time is one tick per reference; the pages one request touches along one chain share the tick of
the chain's start, so a request's pages age together.

The owner files the leaves: the tree calls `file_leaf(key, page)` when a resident page becomes a
leaf and `unfile_leaf(page)` when a filed page stops being one or leaves; a page is filed while
its `filing` is not 0. Around its own updates of a page (a new use, a new score) the owner
unfiles and files it itself.

Verbs: `tick` (count a reference, get its time), `add` (a page becomes resident; `add_covered`
when its child follows at once), `remove` (a page leaves), `has_children`, `is_leaf`, `clone`
(the same tree for another owner's records).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kvtier.policies.base import Key


class TreePage(Protocol):
    """What the tree reads of an owner's page record."""

    parent: Key | None  # the page before it in its prefix; None for a chain's first page
    filing: int  # the owner's current leaf filing; 0 while not filed


PageT = TypeVar("PageT", bound=TreePage)
OtherPageT = TypeVar("OtherPageT", bound=TreePage)


class PrefixTree(Generic[PageT]):
    """Resident pages by key, their resident children counted, and the chain clock."""

    def __init__(self, file_leaf: Callable[[Key, PageT], None],
                 unfile_leaf: Callable[[PageT], None]) -> None:
        self.key_to_page: dict[Key, PageT] = {}
        self.clock = 0  # references seen
        self._chain_clock = 0
        self._last_key: Key | None = None
        # Children resident in this tier, counted for any parent, resident or not.
        self._key_to_num_children: dict[Key, int] = {}
        self._file_leaf = file_leaf
        self._unfile_leaf = unfile_leaf

    def tick(self, key: Key, parent: Key | None) -> int:
        """Count a reference to `key` under `parent`; return its touch time: the tick at which
        its chain (a run of references each under the one before) started."""
        self.clock += 1
        if parent is None or parent != self._last_key:
            self._chain_clock = self.clock  # a new chain starts: a new request
        self._last_key = key
        return self._chain_clock

    def add(self, key: Key, page: PageT) -> None:
        """Make `page` resident as `key` under `page.parent`: the parent is no longer a leaf, and
        `key` is one unless a child of it arrived first."""
        if self.add_covered(key, page):
            self._file_leaf(key, page)

    def add_covered(self, key: Key, page: PageT) -> bool:
        """`add` without filing `key`, for a page whose child the caller adds next (a store's
        run is a chain): it is a leaf only until then, and its filing would be stale at once.
        Returns whether `add` would have filed it (no child of it arrived first)."""
        self.key_to_page[key] = page
        parent = page.parent
        if parent is not None:
            num_children = self._key_to_num_children.get(parent, 0)
            self._key_to_num_children[parent] = num_children + 1
            if not num_children:
                parent_page = self.key_to_page.get(parent)
                if parent_page is not None and parent_page.filing:
                    self._unfile_leaf(parent_page)  # no longer a leaf
        return not self._key_to_num_children.get(key)

    def continue_chain(self, key: Key, page: PageT) -> bool:
        """`tick` then `add_covered` of a new `key` whose parent is the key ticked and added
        covered just before (a store's chain): one reference later, the same touch time.
        Returns whether `add` would have filed it."""
        self.clock += 1
        self._last_key = key
        self.key_to_page[key] = page
        parent = page.parent
        num_children = self._key_to_num_children
        num_children[parent] = num_children.get(parent, 0) + 1
        return not num_children.get(key)

    def remove(self, key: Key) -> PageT:
        """Forget a resident `key` and return its page; its parent becomes a leaf if this was its
        last resident child."""
        page = self.key_to_page.pop(key)
        if page.filing:
            self._unfile_leaf(page)
        if self._last_key == key:
            self._last_key = None
        parent = page.parent
        if parent is None:
            return page
        num_children = self._key_to_num_children[parent] - 1
        if num_children:
            self._key_to_num_children[parent] = num_children
            return page
        del self._key_to_num_children[parent]
        parent_page = self.key_to_page.get(parent)
        if parent_page is not None:  # the parent is resident and a leaf again
            self._file_leaf(parent, parent_page)
        return page

    def clone(self, file_leaf: Callable[[Key, OtherPageT], None],
              unfile_leaf: Callable[[OtherPageT], None],
              key_to_page: dict[Key, OtherPageT]) -> PrefixTree[OtherPageT]:
        """A tree of this one's shape and clock for another owner, whose `key_to_page` holds
        its records of the same resident keys, filed where this tree's leaves are."""
        assert len(key_to_page) == len(self.key_to_page)
        tree: PrefixTree[OtherPageT] = PrefixTree(file_leaf, unfile_leaf)
        tree.key_to_page = key_to_page
        tree.clock, tree._chain_clock = self.clock, self._chain_clock
        tree._last_key = self._last_key
        tree._key_to_num_children = dict(self._key_to_num_children)
        return tree

    def has_children(self, key: Key) -> bool:
        """Whether a resident page has `key` as its parent (`key` itself may not be resident)."""
        return bool(self._key_to_num_children.get(key))

    def is_leaf(self, key: Key) -> bool:
        """Whether `key` is resident with no resident child."""
        return key in self.key_to_page and not self._key_to_num_children.get(key)

    def __len__(self) -> int:
        return len(self.key_to_page)

    def __contains__(self, key: object) -> bool:
        return key in self.key_to_page
