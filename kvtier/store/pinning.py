"""Pinning pages: leases that hold pages against eviction, within a share of each tier.

`Pinning.pin` takes a lease on the present keys (for `ttl_s` seconds or until `unpin`), refusing
one that would take its holder past `max_share` of a tier; `unpin` releases it; expiry, checked
at the start of each of these verbs, frees the pins of a client that died.
Verbs: `pin`, `unpin`, `live_leases`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.errors import QuotaError
from kvtier.keys import Namespace, check_keys
from kvtier.sizes import format_bytes
from kvtier.store.pages import PageEntry
from kvtier.store.parts import StoreParts
from kvtier.store.results import Lease


class Pinning:
    """The `pin`, `unpin` and `live_leases` verbs of `PageStore`, over its shared parts."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts

    def pin(self, namespace: Namespace, keys: Sequence[bytes], ttl_s: float,
            holder_lease_ids: Iterable[int] = (), max_share: float = 1.0) -> Lease:
        """Hold the present `keys` against eviction for `ttl_s` seconds or until `unpin`.

        With `max_share` below 1, the pages of this lease and of the holder's other live leases
        (`holder_lease_ids`) may hold at most that share of each tier's capacity.

        Raises:
            QuotaError: the lease would take the holder past `max_share` of a tier.
        """
        parts = self._parts
        keys = check_keys(keys)
        parts.expire_leases()
        fingerprint = namespace.fingerprint
        with parts.lock:
            entries, missing = [], []
            for key in keys:
                entry = parts.table.get(fingerprint + key)
                if entry is None or entry.best_tier() is None:
                    missing.append(key)
                else:
                    entries.append(entry)
            if max_share < 1.0:
                self._check_pin_share(entries, holder_lease_ids, max_share)
            lease_id = parts.leases.add(entries, ttl_s)
            for entry in entries:
                entry.pins += 1
        return Lease(lease_id, [e.key for e in entries], missing)

    def _check_pin_share(self, entries: list[PageEntry], holder_lease_ids: Iterable[int],
                         max_share: float) -> None:
        """Under the lock: refuse a lease that takes its holder past `max_share` of a tier."""
        parts = self._parts
        by_id = {id(e): e for lease_id in holder_lease_ids
                 for e in parts.leases.entries_of(lease_id)}
        held_before = parts.planner.held_bytes(by_id.values())
        by_id.update((id(e), e) for e in entries)
        held_after = parts.planner.held_bytes(by_id.values())
        for tier, slots in parts.placement.slot_allocators():
            allowed_bytes = int(max_share * slots.capacity_bytes)
            if held_after[tier] > allowed_bytes and held_after[tier] > held_before[tier]:
                raise QuotaError(
                    f"this lease would pin {format_bytes(held_after[tier])} of the {tier.label} "
                    f"tier's {format_bytes(slots.capacity_bytes)}, past this client's share of "
                    f"{max_share:.0%} ({format_bytes(allowed_bytes)}, daemon.max_pinned_share); "
                    f"unpin some pages first, or pin fewer")

    def unpin(self, lease_id: int) -> None:
        """Release a lease.

        Raises:
            ProtocolError: the lease expired or was already released.
        """
        parts = self._parts
        parts.expire_leases()  # an expired lease is gone even if no other verb ran since
        with parts.lock:
            for entry in parts.leases.pop(lease_id):
                entry.pins -= 1

    def live_leases(self, lease_ids: set[int]) -> set[int]:
        """Those of `lease_ids` that are neither released nor expired."""
        parts = self._parts
        parts.expire_leases()
        with parts.lock:
            return {lease_id for lease_id in lease_ids if lease_id in parts.leases}
