"""Leases: time-limited pins of pages for one client.

A lease holds its pages against eviction until `unpin` or until it expires; expiry is what frees
the pins of a client that died. Verbs: `add`, `pop`, `pop_expired`, `entries_of`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from kvtier.errors import ProtocolError
from kvtier.store.pages import PageEntry


class LeaseTable:
    """Live leases by id, with an expiry heap so expiring is O(log n) per lease."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._entries_by_id: dict[int, list[PageEntry]] = {}
        self._expiry_heap: list[tuple[float, int]] = []
        self._next_id = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries_by_id)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._entries_by_id

    def add(self, entries: list[PageEntry], ttl_s: float) -> int:
        """Record a lease over `entries` (already pinned by the caller); return its id."""
        if not 0 < ttl_s < math.inf:
            raise ProtocolError(f"a lease needs a positive ttl_s (finite), got {ttl_s}")
        lease_id = next(self._next_id)
        self._entries_by_id[lease_id] = entries
        heapq.heappush(self._expiry_heap, (self._clock() + ttl_s, lease_id))
        return lease_id

    def entries_of(self, lease_id: int) -> list[PageEntry]:
        """The entries a live lease pins; none for a lease released or expired."""
        return self._entries_by_id.get(lease_id, [])

    def pop(self, lease_id: int) -> list[PageEntry]:
        """Remove a lease and return its entries for the caller to unpin.

        Raises:
            ProtocolError: no live lease has this id (it expired or was never granted).
        """
        try:
            return self._entries_by_id.pop(lease_id)
        except KeyError:
            raise ProtocolError(f"no live lease {lease_id}: it expired or was released") from None

    def pop_expired(self) -> list[list[PageEntry]]:
        """Remove every lease past its expiry; return their entries for the caller to unpin."""
        now = self._clock()
        expired: list[list[PageEntry]] = []
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry_heap)
            entries = self._entries_by_id.pop(lease_id, None)
            if entries is not None:
                expired.append(entries)
        return expired
