"""The page table's values: tiers, page states and one entry per page.

A page may live in several tiers at once (a promoted page keeps its disk copy), so each entry holds
one `Residency` per tier it occupies. Each residency walks WRITING -> READY -> EVICTING. READY ones
are visible to lookup and readable by recall; so is an hbm or host copy while it is EVICTING
(being demoted: its bytes stay whole until its slot is freed, which waits for its last reader),
until its evictor lets it go (`released`). A disk copy being dropped is invisible at once.
`PageEntry.best_tier` is the one place that reads these rules.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from enum import Enum, IntEnum

from kvtier.keys import Namespace


class Tier(IntEnum):
    """Where a page lives, fastest first (the order lookups try them in)."""

    HBM = 0
    HOST = 1
    DISK = 2
    REMOTE = 3  # Redis / Valkey, shared by nodes: no residency here, only a source of recalls

    @property
    def label(self) -> str:
        """The tier's name in the CLI, stats and config: "hbm", "host", "disk"."""
        return self.name.lower()


class PageState(Enum):
    """Life of one residency of a page in one tier."""

    WRITING = "writing"  # slot reserved, bytes not complete: invisible
    READY = "ready"  # bytes complete: visible to lookup, readable by recall
    # Leaving the tier, slot not yet reusable. An hbm or host copy being demoted is still served
    # until its evictor releases it (its bytes stay whole); a disk copy being dropped is not.
    EVICTING = "evicting"


@dataclass(slots=True)
class Residency:
    """One page's slot in one tier."""

    slot: int  # byte offset of the slot in the tier's arena or file
    state: PageState
    readers: int = 0  # copies in flight reading this slot; it is not evictable meanwhile
    released: bool = False  # evicted while read: invisible, the last reader frees the slot
    filed: bool = False  # WRITING, yet already in its tier's policy (`kvtier.store.filing`)


@dataclass(slots=True)
class PageEntry:
    """Everything the store knows about one page (one key of one namespace).

    Built as `PageEntry(scoped_key, namespace, parent=..., ...)`: every field after the namespace
    is keyword-only, so no call site depends on the order of the residencies and counters.
    """

    scoped_key: bytes  # namespace fingerprint + key: unique across namespaces
    namespace: Namespace
    _: KW_ONLY
    parent: bytes | None = None  # scoped key of the previous page of the prefix, when known
    hbm: Residency | None = None
    host: Residency | None = None
    disk: Residency | None = None
    checksum: int | None = None  # xxh3-64 of the payload, once computed
    pins: int = 0  # live leases holding the page
    hits: int = 0
    deleted: bool = False  # removed from the table; slots freed when the last reader leaves
    last_access_s: float = 0.0

    @property
    def key(self) -> bytes:
        """The engine's 16-byte key."""
        return self.scoped_key[16:]

    def residency(self, tier: Tier) -> Residency | None:
        """This page's residency in `tier`, or None (always None for the remote tier)."""
        name = RESIDENCY_FIELDS.get(tier)
        return getattr(self, name) if name is not None else None

    def residency_in(self, tier: Tier) -> Residency:
        """This page's residency in `tier`, which the caller knows it has (it reserved,
        read-holds or is evicting it)."""
        residency = self.residency(tier)
        assert residency is not None, f"page {self.key.hex()} has no {tier.label} residency"
        return residency

    def set_residency(self, tier: Tier, residency: Residency | None) -> None:
        """Give this page `residency` in `tier` (hbm, host or disk), or take it away (None)."""
        setattr(self, RESIDENCY_FIELDS[tier], residency)

    def best_tier(self) -> Tier | None:
        """The fastest tier holding a readable copy, or None when none is visible: READY, or
        an hbm or host copy being demoted that its evictor has not let go yet."""
        hbm, host = self.hbm, self.host
        if hbm is not None and (hbm.state is PageState.READY or (
                hbm.state is PageState.EVICTING and not hbm.released)):
            return Tier.HBM
        if host is not None and (host.state is PageState.READY or (
                host.state is PageState.EVICTING and not host.released)):
            return Tier.HOST
        if self.disk is not None and self.disk.state is PageState.READY:
            return Tier.DISK
        return None


# The PageEntry field holding each local tier's residency.
RESIDENCY_FIELDS = {Tier.HBM: "hbm", Tier.HOST: "host", Tier.DISK: "disk"}


def present_prefix(tiers: list[Tier | None]) -> int:
    """How many leading keys of a lookup are present (have a tier): the prefix an engine reuses."""
    # Two scans in C cost a tenth of one generator scan in Python, for a short lookup.
    return tiers.index(None) if None in tiers else len(tiers)
