"""The page table (scoped key -> `PageEntry`), which tells one observer what lookups may see.

The lookup plane publishes the keys a node holds (`kvtier.daemon.lookup_plane`); this is its one
hook into the store. `page_ready` is called where a residency becomes READY (placement's
`track_ready`: stores, promotions, disk writes, disk recovery), and removing an entry (the key
left its last tier, or was deleted) reports `page_gone`; both under the store's lock, so the
observer sees one ordered stream. A page may be reported ready more than once (one per tier).
Verbs: `PageTable.page_ready`, `pop`, `del`, and the `observer` attribute.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvtier.store.pages import PageEntry


class PageObserver(Protocol):
    """What the page table reports (called under the store's lock: keep it short)."""

    def page_ready(self, entry: PageEntry) -> None:
        """A copy of `entry` became READY (it may have been READY elsewhere already)."""

    def page_gone(self, entry: PageEntry) -> None:
        """`entry` left the table: no tier holds it any more, or it was deleted."""


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
