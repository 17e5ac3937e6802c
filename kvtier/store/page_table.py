"""The page table (scoped key -> `PageEntry`), which tells one observer what lookups may see.

The lookup plane publishes the keys a node holds (`kvtier.daemon.lookup_plane`); this is its one
hook into the store. `page_ready` is called where a residency becomes READY (placement's
`track_ready`: promotions, disk writes, disk recovery), `pages_ready` once for a store's pages,
and removing an entry (the key left its last tier, or was deleted) reports `page_gone`; all under
the store's lock, so the observer sees one ordered stream. A page may be reported ready more than
once (one per tier).
Verbs: `PageTable.page_ready`, `pages_ready`, `pop`, `del`, `pages_gone_now`, `shrink`, and the
`observer` attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.dict_room import shrink
from kvtier.store.pages import PageEntry


class PageObserver(Protocol):
    """What the page table reports (called under the store's lock: keep it short)."""

    def page_ready(self, entry: PageEntry) -> None:
        """A copy of `entry` became READY (it may have been READY elsewhere already)."""

    def pages_ready(self, entries: Sequence[PageEntry]) -> None:
        """`page_ready` for each of `entries` (a store's pages), in one call."""

    def page_gone(self, entry: PageEntry) -> None:
        """`entry` left the table: no tier holds it any more, or it was deleted (the observer
        may act on it later, by the next `pages_gone_now` at the latest)."""

    def pages_gone_now(self) -> None:
        """Act now on every `page_gone` so far (a delete: its keys leave lookups at once)."""

    def shrink(self) -> int:
        """Give back the room of the keys gone (`kvtier.dict_room`); the bytes given back."""


class PageTable(dict[bytes, PageEntry]):
    """A dict with an optional observer; reads are the plain dict's."""

    __slots__ = ("observer",)

    def __init__(self) -> None:
        super().__init__()
        self.observer: PageObserver | None = None

    def page_ready(self, entry: PageEntry) -> None:
        """Report that a copy of `entry` became READY."""
        if self.observer is not None:
            self.observer.page_ready(entry)

    def pages_ready(self, entries: Sequence[PageEntry]) -> None:
        """Report that a copy of each of `entries` became READY."""
        if self.observer is not None and entries:
            self.observer.pages_ready(entries)

    def pages_gone_now(self) -> None:
        """Have the observer act now on the pages reported gone."""
        if self.observer is not None:
            self.observer.pages_gone_now()

    def shrink(self) -> int:
        """Rebuild the table and the observer's if most of their keys went (a large delete);
        the bytes given back."""
        given_back = shrink(self)
        if self.observer is not None:
            given_back += self.observer.shrink()
        return given_back

    def __delitem__(self, key: bytes) -> None:
        entry = self[key]
        super().__delitem__(key)
        if self.observer is not None:
            self.observer.page_gone(entry)

    def pop(self, key: bytes, *default: Any) -> Any:
        entry = super().pop(key, *default)
        if self.observer is not None and isinstance(entry, PageEntry):
            self.observer.page_gone(entry)
        return entry
