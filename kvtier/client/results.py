"""What the client's verbs return: a pool handle, a job's result, a lookup's answer.

Plain values, the same for `Client` and `AsyncClient`; `kvtier.client.verbs` builds them from
the daemon's replies. Verbs: `JobResult.ok`, `RotateResult.ok`.
"""

from __future__ import annotations

from collections.abc import Callable
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


class LookupReply:
    """Longest present prefix and each key's tier ("hbm", "host", "disk" or None).

    An answer from the lookup plane's index (`Client.lookup` on a namespace handle) knows the
    prefix only: reading `tiers` then asks the daemon (one round trip, on first read), whose
    answer may be newer than `num_prefix`.
    """

    __slots__ = ("num_prefix", "_tiers", "_ask_tiers")

    def __init__(self, num_prefix: int, tiers: list[str | None] | None = None,
                 ask_tiers: Callable[[], list[str | None]] | None = None) -> None:
        if tiers is None and ask_tiers is None:
            raise ValueError("a lookup reply needs its tiers or a way to ask for them")
        self.num_prefix = num_prefix
        self._tiers = tiers
        self._ask_tiers = ask_tiers

    @property
    def tiers(self) -> list[str | None]:
        """Each key's tier, or None where absent."""
        if self._tiers is None:
            assert self._ask_tiers is not None
            self._tiers = self._ask_tiers()
        return self._tiers

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LookupReply):
            return NotImplemented
        return self.num_prefix == other.num_prefix and self.tiers == other.tiers

    __hash__ = None  # type: ignore[assignment]  # mutable once tiers are asked

    def __repr__(self) -> str:
        tiers = "?" if self._tiers is None else repr(self._tiers)
        return f"LookupReply(num_prefix={self.num_prefix}, tiers={tiers})"
