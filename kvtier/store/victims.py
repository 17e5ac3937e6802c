"""Which pages leave a full tier: the policy's order, and whole chunks for a page size moving in.

A tier's slots are carved chunk by chunk, one page size per chunk (`kvtier.tiers.slots`). A
victim of the size that is waiting frees a slot it can use; a victim of another size frees one
only when its whole chunk empties. Evicting in the policy's order alone, a new page size would
evict page after page across every chunk until one of them happened to empty: nearly the whole
tier. So the first victim of another size takes its chunk's other pages with it (when none of
them is pinned, read or written) and that one chunk is the price of the new size. Its other
pages are found by their slots (placement keeps each tier's pages by slot offset): a walk of the
whole table for them cost 16 ms at 38,000 pages, under the store's lock, in every store that met
a victim of another size (three models' page sizes in one tier: about one store in thirteen).

Verbs: `choose_victims`. Called by placement with the store's lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import cast

from kvtier.policies import EvictionPolicy
from kvtier.store.pages import PageEntry, PageState, Tier
from kvtier.tiers.slots import SlabAllocator


def choose_victims(tier: Tier, waiting: list[PageEntry], policy: EvictionPolicy,
                   table: dict[bytes, PageEntry], slots: SlabAllocator,
                   page_at: dict[int, PageEntry],
                   slot_bytes_of: Callable[[PageEntry], int]) -> list[PageEntry]:
    """Mark EVICTING enough pages of `tier` to make room for `waiting`; return them.

    Fewer (or none) when the others cannot be evicted (pinned, being read or written).
    """
    needed_slots: dict[int, int] = {}  # slot bytes -> slots still wanted
    for entry in waiting:
        slot_bytes = slot_bytes_of(entry)
        needed_slots[slot_bytes] = needed_slots.get(slot_bytes, 0) + 1

    def can_evict(scoped_key: Hashable) -> bool:
        entry = table[cast(bytes, scoped_key)]  # policies hold scoped keys
        residency = entry.residency(tier)
        return (residency is not None and residency.state is PageState.READY
                and residency.readers == 0 and entry.pins == 0)

    victims: list[PageEntry] = []
    emptied_chunk_ids: set[int] = set()
    in_order = policy.victims(can_evict)  # evicts only as far as it is asked
    try:
        while needed_slots:
            scoped_key = next(in_order, None)
            if scoped_key is None:
                break
            entry = table[cast(bytes, scoped_key)]
            residency = entry.residency_in(tier)
            residency.state = PageState.EVICTING
            victims.append(entry)
            slot_bytes = slot_bytes_of(entry)
            if slot_bytes in needed_slots:
                _count_room(needed_slots, slot_bytes, 1)
                continue
            chunk_id = slots.chunk_of(residency.slot)
            if chunk_id in emptied_chunk_ids:
                continue
            mates = [mate for offset in slots.carved_offsets(chunk_id)
                     if (mate := page_at.get(offset)) is not None and mate is not entry]
            if not all(_leaving(m, tier) or can_evict(m.scoped_key) for m in mates):
                continue  # the chunk cannot empty now: this victim alone leaves, as the policy said
            for mate in mates:
                mate_residency = mate.residency_in(tier)
                if mate_residency.state is PageState.READY:
                    policy.on_remove(mate.scoped_key)
                    mate_residency.state = PageState.EVICTING
                    victims.append(mate)
            emptied_chunk_ids.add(chunk_id)
            # An empty chunk is carved anew for whichever size waits: count it for the first.
            first = next(iter(needed_slots))
            _count_room(needed_slots, first, slots.chunk_bytes // first)
    finally:
        in_order.close()
    return victims


def _count_room(needed_slots: dict[int, int], slot_bytes: int, num_slots: int) -> None:
    left = needed_slots[slot_bytes] - num_slots
    if left > 0:
        needed_slots[slot_bytes] = left
    else:
        del needed_slots[slot_bytes]


def _leaving(entry: PageEntry, tier: Tier) -> bool:
    """Whether the page's copy in `tier` is already being evicted (its slot frees soon)."""
    return entry.residency_in(tier).state is PageState.EVICTING
