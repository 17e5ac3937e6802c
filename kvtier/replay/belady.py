"""Belady's OPT for offline replay: the hit ratio no online policy of one tier can beat.

Requests in order; every missed page that can be stored is inserted; when the tier is full, the
resident page whose next use is farthest in the future leaves. Pages that cannot be stored (a
request's partly filled last page: engines never store it) are looked up but never inserted, the
same rule `kvtier.replay.replayer` applies to the online policies.

Verbs: `opt_hits`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

_NEVER = 1 << 62  # next use of a page that is not used again


def opt_hits(references: Sequence[int], storable: Sequence[bool], capacity_pages: int) -> int:
    """Count the hits of Belady's OPT over `references` (page ids) in a tier of `capacity_pages`.

    Args:
        references: page ids in reference order.
        storable: for each reference, whether a miss on it may insert the page.
        capacity_pages: the tier's size in pages; 0 gives no hits.
    """
    if capacity_pages <= 0:
        return 0
    next_use = [_NEVER] * len(references)
    upcoming: dict[int, int] = {}
    for position in range(len(references) - 1, -1, -1):
        page = references[position]
        next_use[position] = upcoming.get(page, _NEVER)
        upcoming[page] = position
    resident_next_use: dict[int, int] = {}
    # Max-heap by next use; entries go stale when the page is used again (lazy deletion).
    farthest: list[tuple[int, int]] = []
    hits = 0
    for position, page in enumerate(references):
        if page in resident_next_use:
            hits += 1
        elif not storable[position]:
            continue
        elif len(resident_next_use) >= capacity_pages:
            while True:
                negative_use, victim = heapq.heappop(farthest)
                if resident_next_use.get(victim) == -negative_use:
                    del resident_next_use[victim]
                    break
        resident_next_use[page] = next_use[position]
        heapq.heappush(farthest, (-next_use[position], page))
    return hits
