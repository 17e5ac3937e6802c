"""What the page store's verbs return: one value type per verb.

`LookupResult` (lookup), `StoreResult` (store), `RecallResult` (recall, prefetch), `SwapResult`
(rotate), `Lease` (pin). Every requested key appears in exactly one of a result's lists or maps.
(The client's `RotateResult` is the same outcome as the client sees it, built from the reply.)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.store.pages import Tier


@dataclass(slots=True)  # not frozen: a frozen init costs a lookup on the loop 0.2 us more
class LookupResult:
    """Which keys the store holds: `tiers[i]` is key i's fastest tier, or None."""

    num_prefix: int  # leading keys present: the prefix an engine can reuse
    tiers: list[Tier | None]


@dataclass(slots=True, frozen=True)
class StoreResult:
    """Outcome of a store: every key lands in exactly one of the three fields."""

    stored: list[bytes]
    already_present: list[bytes]
    failed: dict[bytes, str]

    @property
    def ok(self) -> bool:
        """True when no key failed."""
        return not self.failed


@dataclass(slots=True, frozen=True)
class RecallResult:
    """Outcome of a recall: `out[i]` was written only for keys in `recalled`."""

    recalled: list[bytes]
    tiers: list[Tier | None]  # where each requested key was served from, None if it was not
    missing: list[bytes]
    failed: dict[bytes, str]  # present but unreadable (I/O or integrity); treated as misses

    @property
    def ok(self) -> bool:
        """True when every key was recalled."""
        return not self.missing and not self.failed


@dataclass(slots=True, frozen=True)
class SwapResult:
    """Outcome of a rotate: its swap-out as a store, its swap-in as a recall."""

    stored: StoreResult
    recalled: RecallResult

    @property
    def ok(self) -> bool:
        """True when every page was swapped out and every page swapped in."""
        return self.stored.ok and self.recalled.ok


@dataclass(slots=True, frozen=True)
class Lease:
    """A pin on pages: `lease_id` for `unpin`, the keys it holds and those it could not."""

    lease_id: int
    pinned: list[bytes]
    missing: list[bytes]
