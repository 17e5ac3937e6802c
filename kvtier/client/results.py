"""What the client's verbs return: a pool handle, a job's result, a lookup's answer.

Plain values, the same for `Client` and `AsyncClient`; `kvtier.client.verbs` builds them from
the daemon's replies. Verbs: `JobResult.ok`, `RotateResult.ok`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.keys import Namespace


@dataclass(slots=True, frozen=True)
class PoolHandle:
    """A registered pool: its id on this connection and its namespace."""

    pool_id: int
    namespace: Namespace
    page_bytes: int


@dataclass(slots=True, frozen=True)
class JobResult:
    """Completion of a store, recall or prefetch."""

    num_done: int
    failed: dict[bytes, str]  # key -> why it failed
    missing: list[bytes]  # recall: keys the daemon does not hold
    tiers: list[str | None]  # recall: where each key was served from

    @property
    def ok(self) -> bool:
        """True when every key was done."""
        return not self.failed and not self.missing


@dataclass(slots=True, frozen=True)
class RotateResult:
    """Completion of a rotate: the swap-out as a store's result, the swap-in as a recall's."""

    stored: JobResult
    recalled: JobResult

    @property
    def ok(self) -> bool:
        """True when every page was swapped out and every page swapped in."""
        return self.stored.ok and self.recalled.ok


@dataclass(slots=True, frozen=True)
class LookupReply:
    """Longest present prefix and each key's tier ("hbm", "host", "disk" or None)."""

    num_prefix: int
    tiers: list[str | None]
