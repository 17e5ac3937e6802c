"""PageStore: the in-process page store over the hbm (when configured), host and disk tiers.

Verbs: `store`, `lookup`, `recall`, `rotate`, `delete`, `pin` / `unpin`, `stats`, `check`,
`close`; `open_lanes` adds a transfer engine over the host arena. The verbs live in layers:
`kvtier.store.core` (state, namespaces), `storing`, `recalling`, `rotation`, then this module.

Every verb runs in three steps so bytes never move under the store's lock: plan under the lock
(reserve slots, mark residencies WRITING or EVICTING, take reader counts), copy without it, then
commit under it (READY, free slots). A residency is visible to lookup only when READY, so a key is
never served before its bytes are complete. Eviction cascades hbm -> host -> disk -> dropped; a
disk hit is promoted to host and keeps its disk copy, a host hit on its `hbm.promote_hits`-th
hit is promoted to hbm and keeps its host copy.

Copies between the host arena and an engine pool bound to a transfer engine (`bind_lanes`, as the
daemon does) go through that engine: stores on its d2h lane, recalls on its h2d lane, each batch
as few large copies, both lanes running at once; a failed copy fails exactly its keys. Callers
passing numpy buffers are copied in their own thread. Every copy goes through
`kvtier.store.movers`, one route per (source, destination); a disk hit into an engine pool
crosses into the pool once (its host copy is made from the rows the read landed in).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from functools import partial

from kvtier.config import StoreConfig
from kvtier.errors import QuotaError
from kvtier.keys import Namespace, check_keys
from kvtier.sizes import format_bytes
from kvtier.store.pages import PageEntry, Tier, present_prefix
from kvtier.store.remote_link import RemoteLink
from kvtier.store.results import Lease, LookupResult
from kvtier.store.rotation import Rotating
from kvtier.store.stats import StoreCounters, StoreStats, TierStats
from kvtier.pools.page_access import PageBuffers
from kvtier.tiers.remote import RemoteTier
from kvtier.transfer.duplex import Backend, DuplexLanes

__all__ = ["PageBuffers", "PageStore"]


class PageStore(Rotating):
    """Pages of any number of namespaces across a host arena and a disk directory.

    Thread-safe: callers may run verbs from several threads (the daemon runs copies in a pool).

    Args:
        config: capacities, policies, write policy; `StoreConfig()` gives working defaults.
        clock: monotonic seconds, injectable for lease tests.
        transfer_backend: when given, an engine over the host arena under the key
            `transfer_backend.name` (see `open_lanes`).

    Raises:
        StorageError: the arena or the disk directory cannot be created or is in use.
    """

    def __init__(self, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 transfer_backend: Backend | None = None) -> None:
        super().__init__(config, clock)
        if transfer_backend is not None:
            self.open_lanes(transfer_backend.name, transfer_backend)
        if self.config.remote.enabled and self.config.with_bytes:
            self._open_remote()

    def _open_remote(self) -> None:
        self.remote = RemoteTier(self.config.remote)
        self._remote_link = RemoteLink(self.remote, self._placement.host_view, self.disk,
                                       partial(self.store, remote_write=False))
        if not self._remote_link.sends_on_store:
            self._cascade.on_last_copy = self._remote_link.spill

    def wait_remote_promotions(self, timeout_s: float | None = None) -> None:
        """Block until the pages recent recalls fetched from the remote tier are in host.

        A recall serves remote pages at once and stores them in host afterwards, off its path;
        this waits for those stores (a no-op without a remote tier).
        """
        if self._remote_link is not None:
            self._remote_link.wait_promotions(timeout_s)

    def open_lanes(self, lanes_key: str, backend: Backend) -> DuplexLanes:
        """A transfer engine over the host arena under `lanes_key`, started on first call.

        Pages bound to `lanes_key` (`PoolPageAccess.bind_lanes`) move through it. A second call
        with the same key returns the running engine (and leaves `backend` unused). With an hbm
        tier the engine can reach (host memory for a CPU backend, the same GPU for a CUDA one),
        a second engine over the hbm tier serves that engine's recalls of hbm hits.

        Raises:
            ProtocolError: a metadata-only store has no arena to move pages to.
        """
        with self._lock:
            return self._movers.open_lanes(lanes_key, backend)

    def lookup(self, namespace: Namespace, keys: Sequence[bytes],
               remote: bool = True) -> LookupResult:
        """Report the fastest tier of each key and the length of the present prefix.

        Lookups count hits and misses per tier; they do not move pages or change policy order.
        With a remote tier (and `remote`), keys missing locally after the local prefix are
        fetched in one round trip and the leading run of them stored in host before returning
        (see `remote_may_extend`).
        """
        keys = check_keys(keys)
        fingerprint = namespace.fingerprint
        tiers: list[Tier | None] = []
        with self._lock:
            for key in keys:
                entry = self._table.get(fingerprint + key)
                tiers.append(entry.best_tier() if entry is not None else None)
            self._placement.count_lookups(tiers)
        result = LookupResult(present_prefix(tiers), tiers)
        return self.extend_lookup(namespace, keys, result) if remote else result

    def remote_may_extend(self, result: LookupResult) -> bool:
        """Whether the remote tier could lengthen this local lookup's prefix (it is connected
        and the prefix stops short): the daemon then finishes the lookup off its event loop."""
        return (self.remote is not None and self.remote.connected
                and result.num_prefix < len(result.tiers))

    def extend_lookup(self, namespace: Namespace, keys: Sequence[bytes],
                      result: LookupResult) -> LookupResult:
        """Finish a local lookup (`lookup(..., remote=False)`) with the remote tier."""
        if self._remote_link is None or result.num_prefix == len(result.tiers):
            return result
        tiers = list(result.tiers)
        self._remote_link.extend_prefix(namespace, check_keys(keys), tiers)
        return LookupResult(present_prefix(tiers), tiers)

    def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """Remove `keys` from every tier; return how many were present.

        Copies in flight finish first: a slot is freed only when its last reader leaves.
        """
        keys = check_keys(keys)
        with self._lock:
            num_removed, to_drop = self._placement.unlink(namespace.fingerprint, keys)
        self._cascade.drop_from_disk(to_drop)
        return num_removed

    def pin(self, namespace: Namespace, keys: Sequence[bytes], ttl_s: float,
            holder_lease_ids: Iterable[int] = (), max_share: float = 1.0) -> Lease:
        """Hold the present `keys` against eviction for `ttl_s` seconds or until `unpin`.

        With `max_share` below 1, the pages of this lease and of the holder's other live leases
        (`holder_lease_ids`) may hold at most that share of each tier's capacity.

        Raises:
            QuotaError: the lease would take the holder past `max_share` of a tier.
        """
        keys = check_keys(keys)
        self._expire_leases()
        fingerprint = namespace.fingerprint
        with self._lock:
            entries, missing = [], []
            for key in keys:
                entry = self._table.get(fingerprint + key)
                if entry is None or entry.best_tier() is None:
                    missing.append(key)
                else:
                    entries.append(entry)
            if max_share < 1.0:
                self._check_pin_share(entries, holder_lease_ids, max_share)
            lease_id = self._leases.add(entries, ttl_s)
            for entry in entries:
                entry.pins += 1
        return Lease(lease_id, [e.key for e in entries], missing)

    def _check_pin_share(self, entries: list[PageEntry], holder_lease_ids: Iterable[int],
                         max_share: float) -> None:
        """Under the lock: refuse a lease that takes its holder past `max_share` of a tier."""
        by_id = {id(e): e for lease_id in holder_lease_ids
                 for e in self._leases.entries_of(lease_id)}
        held_before = self._placement.held_bytes(by_id.values())
        by_id.update((id(e), e) for e in entries)
        held_after = self._placement.held_bytes(by_id.values())
        for tier, slots in self._placement.slot_allocators():
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
        self._expire_leases()  # an expired lease is gone even if no other verb ran since
        with self._lock:
            for entry in self._leases.pop(lease_id):
                entry.pins -= 1

    def live_leases(self, lease_ids: set[int]) -> set[int]:
        """Those of `lease_ids` that are neither released nor expired."""
        self._expire_leases()
        with self._lock:
            return {lease_id for lease_id in lease_ids if lease_id in self._leases}

    def stats(self) -> StoreStats:
        """A snapshot of capacities, occupancy, hit counters and traffic."""
        self._expire_leases()
        with self._lock:
            tiers = tuple(
                TierStats(tier.label, slots.capacity_bytes, slots.used_bytes, slots.num_used,
                          **asdict(self._placement.counters_of(tier)))
                for tier, slots in self._placement.slot_allocators()
            )
            counters = StoreCounters(**asdict(self._counters))
            remote = self.remote.stats() if self.remote is not None else None
            return StoreStats(tiers, counters, len(self._leases), len(self._namespaces), remote)

    def check(self, verify_bytes: bool = True) -> list[str]:
        """Walk every page and return a list of problems; empty when the store is sound.

        Checks slot accounting, policy tracking, the disk index against the table, and, with
        `verify_bytes`, every disk page's header and checksum and every host page whose checksum
        is known.
        """
        with self._lock:
            return self._placement.check(verify_bytes)

    def flush(self) -> None:
        """Make every disk index update so far durable (the daemon calls it every second)."""
        if self.disk is not None:
            self.disk.sync_index()

    def close(self) -> None:
        """Persist disk access data, close the index and release the arena (idempotent)."""
        if self._remote_link is not None and not self._closed:
            self._remote_link.close()  # its promotions take the lock: finish them first
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.remote is not None:
                self.remote.close()  # queued writes go out while the arena still exists
            self._movers.close()  # lanes drain before the arenas go away
            self._cascade.demote_at_close()
            self._placement.close()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
