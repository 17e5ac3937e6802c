"""Placement: which tier holds each page, in which state, and which pages leave a full tier.

The hbm tier (when configured) takes hot pages: a page served from host on its
`hbm.promote_hits`-th hit is copied up, keeping its host copy; an hbm victim without a host copy
is demoted to host, which may cascade on to disk (hbm -> host -> disk -> dropped).

`Placement` holds the tiers (built by `kvtier.tiers.build.build_tiers`, one `Tier -> tier`
mapping), their slot accounting and their policies, and the page states: it decides and
records, and moves no bytes. Every method expects the store's lock held.
`kvtier.store.planner` makes the verbs' plans over it, `kvtier.store.cascade` drives the eviction
cascade (it takes the lock around these calls), `kvtier.store.movers` moves the bytes, and
`PageStore` holds all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from operator import attrgetter

import numpy as np

from kvtier.config import StoreConfig, WritePolicy
from kvtier.dict_room import shrink
from kvtier.errors import CapacityError
from kvtier.keys import Namespace
from kvtier.policies import EvictionPolicy, make_policy
from kvtier.store.integrity import TierView, check_pages
from kvtier.store.page_table import PageTable
from kvtier.store.pages import RESIDENCY_FIELDS, PageEntry, PageState, Residency, Tier
from kvtier.store.stats import StoreCounters, TierCounters
from kvtier.store.victims import choose_victims
from kvtier.tiers.base import SlotTier
from kvtier.tiers.build import StoreTiers
from kvtier.tiers.disk import DiskRecord
from kvtier.tiers.slots import SlabAllocator

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Reservation:
    """Entries that got a WRITING slot from this call, and why the others did not."""

    reserved: list[PageEntry]
    failed: dict[bytes, str]


class Placement:
    """Tiers, slot accounting, policies and page states (`Planner` makes the verbs' plans
    over it)."""

    def __init__(self, config: StoreConfig, tiers: StoreTiers, table: PageTable,
                 counters: StoreCounters) -> None:
        self.config = config
        self._table = table
        self._counters = counters
        # Deleted pages whose slots a copy in flight still holds (being written, read or
        # evicted; id -> entry): out of the table, so the integrity walk counts them here.
        self._detached: dict[int, PageEntry] = {}
        self._store_tiers = tiers
        self.host = tiers.host
        self.disk = tiers.disk
        self.hbm = tiers.hbm
        # The enabled tiers, fastest first: every per-tier question is a lookup here.
        self.tiers: dict[Tier, SlotTier] = {}
        if self.hbm is not None:
            self.tiers[Tier.HBM] = self.hbm
        self.tiers[Tier.HOST] = self.host
        if self.disk is not None:
            self.tiers[Tier.DISK] = self.disk
        self._policy_names = {Tier.HBM: config.hbm.policy, Tier.HOST: config.host.policy,
                              Tier.DISK: config.disk.policy}
        # Each tier's policy, made on first use (`policy`): others read it, never assign it.
        self.policies: dict[Tier, EvictionPolicy] = {}
        self._tier_counters = {Tier.HBM: TierCounters(), Tier.HOST: TierCounters(),
                               Tier.DISK: TierCounters()}
        self._slot_bytes_cache: dict[tuple[Tier, int], int] = {}
        # Each tier's pages by the offset of their slot: a chunk's pages without a walk of the
        # table (`kvtier.store.victims`, when a page size moving in empties a chunk).
        self._page_at: dict[Tier, dict[int, PageEntry]] = {tier: {} for tier in self.tiers}

    def slot_allocators(self) -> Iterator[tuple[Tier, SlabAllocator]]:
        """Each enabled tier with its slot accounting, fastest first."""
        for tier, storage in self.tiers.items():
            yield tier, storage.slots

    def counters_of(self, tier: Tier) -> TierCounters:
        """The running counters of `tier`."""
        return self._tier_counters[tier]

    def slot_bytes(self, tier: Tier, namespace: Namespace) -> int:
        """Bytes of the slot a page of `namespace` takes in `tier`."""
        return self._slot_bytes(tier, namespace)

    def _slot_bytes(self, tier: Tier, namespace: Namespace) -> int:
        # Cached: this is asked for every page on the hot path.
        cache_key = (tier, namespace.page_bytes)
        slot_bytes = self._slot_bytes_cache.get(cache_key)
        if slot_bytes is None:
            slot_bytes = self.tiers[tier].slot_bytes_for(namespace.page_bytes)
            self._slot_bytes_cache[cache_key] = slot_bytes
        return slot_bytes

    def _slots(self, tier: Tier) -> SlabAllocator:
        return self.tiers[tier].slots

    def host_bytes(self, entry: PageEntry) -> np.ndarray | None:
        """The host slot of `entry` as a uint8 view, or None in metadata-only mode."""
        if not self.config.with_bytes:
            return None
        return self.host.view(entry.residency_in(Tier.HOST).slot, entry.namespace.page_bytes)

    def check_fits(self, namespace: Namespace) -> None:
        """Raise CapacityError when a page of `namespace` cannot fit a tier's chunk."""
        for tier, _ in self.slot_allocators():
            try:
                self._slot_bytes(tier, namespace)
            except CapacityError as exc:  # name the tier and the setting to change
                raise CapacityError(f"{tier.label} tier: {exc} (setting {tier.label}.chunk)"
                                    ) from None

    def tidy_policies(self) -> None:
        """Let each tier's policy do its deferred bookkeeping; called without the store's lock
        (`EvictionPolicy.tidy`)."""
        for policy in list(self.policies.values()):  # one C-level copy: safe beside a new tier
            policy.tidy()

    def shrink_steps(self) -> list[Callable[[], int]]:
        """What gives back the room of the pages gone (`kvtier.dict_room`), each to call under
        the store's lock: the slot maps, the detached pages, each tier's policy."""
        page_maps = [*self._page_at.values(), self._detached]
        return ([partial(shrink, pages) for pages in page_maps]
                + [policy.shrink for policy in list(self.policies.values())])

    def policy(self, tier: Tier, namespace: Namespace) -> EvictionPolicy:
        # Created on first use: a policy's capacity in pages depends on the first page size seen.
        policy = self.policies.get(tier)
        if policy is None:
            slots = self._slots(tier)
            capacity_pages = max(1, slots.capacity_bytes // self._slot_bytes(tier, namespace))
            policy = make_policy(self._policy_names[tier], capacity_pages)
            self.policies[tier] = policy
        return policy

    def adopt(self, entry: PageEntry, tier: Tier) -> None:
        """Record the slot of a residency made outside `alloc_slots` (a disk page recovered at
        start, its slot claimed from the index)."""
        self._page_at[tier][entry.residency_in(tier).slot] = entry

    def track_ready(self, entry: PageEntry, tier: Tier) -> None:
        """Hand a READY residency to its tier's policy (and the page table's observer)."""
        self._table.page_ready(entry)
        self.policy(tier, entry.namespace).on_insert(entry.scoped_key, entry.parent)

    def alloc_slots(self, tier: Tier, pending: list[PageEntry],
                     reserved: list[PageEntry]) -> list[PageEntry]:
        """Give WRITING slots to as many pending entries as fit; return those still waiting."""
        field_name = RESIDENCY_FIELDS[tier]
        residency_of = attrgetter(field_name)
        # One slot per entry even if a request names a page twice (a recall of [k, k] promotes
        # one page): a second slot would be overwritten and leak.
        unique = {id(e): e for e in pending}.values()
        wanted = [e for e in unique if not e.deleted and residency_of(e) is None]
        first_page_bytes = wanted[0].namespace.page_bytes if wanted else 0
        if all(e.namespace.page_bytes == first_page_bytes for e in wanted):
            groups = [wanted] if wanted else []  # the common case: one page size per batch
        else:
            by_page_bytes: dict[int, list[PageEntry]] = {}
            for entry in wanted:
                by_page_bytes.setdefault(entry.namespace.page_bytes, []).append(entry)
            groups = list(by_page_bytes.values())
        waiting: list[PageEntry] = []
        writing = PageState.WRITING
        page_at = self._page_at[tier]
        for same_size in groups:
            slot_bytes = self._slot_bytes(tier, same_size[0].namespace)
            slots = self._slots(tier).alloc_many(slot_bytes, len(same_size))
            for entry, slot in zip(same_size, slots):
                setattr(entry, field_name, Residency(slot, writing))
            page_at.update(zip(slots, same_size))
            reserved += same_size[: len(slots)]
            waiting += same_size[len(slots) :]
        return waiting

    def choose_victims(self, tier: Tier, waiting: list[PageEntry]) -> list[PageEntry]:
        """Mark EVICTING the pages that leave `tier` to make room for `waiting` (see
        `kvtier.store.victims`); return them."""
        policy = self.policies.get(tier)
        if policy is None:
            return []
        return choose_victims(tier, waiting, policy, self._table, self._slots(tier),
                              self._page_at[tier],
                              lambda entry: self._slot_bytes(tier, entry.namespace))

    def make_ready(self, tier: Tier, copied: list[PageEntry]) -> int:
        """Make the WRITING copies of `copied` in `tier` READY, counting the bytes written, or
        free them for pages deleted meanwhile. Returns how many became READY."""
        num_ready = 0
        for entry in copied:
            if entry.deleted:
                self.release(entry, tier)
                continue
            entry.residency_in(tier).state = PageState.READY
            self.track_ready(entry, tier)
            self._tier_counters[tier].bytes_written += entry.namespace.page_bytes
            num_ready += 1
        return num_ready

    def release_victims(self, tier: Tier, victims: list[PageEntry]) -> None:
        """Free the slots of evicted `victims` in `tier` (a victim being read: its last reader)."""
        # A victim whose copy in the tier below stays (a promoted page keeps it) moves down
        # without a write: that copy's policy sees it as just arrived, else it could leave
        # before pages of the same prefix that were used less recently (a stranded tail).
        below = {Tier.HBM: Tier.HOST, Tier.HOST: Tier.DISK}.get(tier)
        below_policy = self.policies.get(below) if below is not None else None
        for victim in victims:
            if below is not None and below_policy is not None:
                copy = victim.residency(below)
                if copy is not None and copy.state is PageState.READY:
                    below_policy.on_access(victim.scoped_key)
            self._tier_counters[tier].evictions += 1
            residency = victim.residency(tier)
            if residency is not None and residency.readers:
                residency.released = True  # read while being demoted: its last reader frees it
                continue
            self.release(victim, tier)
            self.forget_if_nowhere(victim)

    def forget_if_nowhere(self, entry: PageEntry) -> None:
        """Forget an evicted page that has no copy left in any tier: counted as dropped."""
        if (entry.host is None and entry.disk is None and entry.hbm is None
                and not entry.deleted):
            del self._table[entry.scoped_key]
            entry.deleted = True
            self._counters.pages_dropped += 1

    def should_demote(self, entry: PageEntry) -> bool:
        if self.disk is None or entry.disk is not None:
            return False
        policy = self.config.write_policy
        return policy is WritePolicy.WRITE_BACK or (
            policy is WritePolicy.SELECTIVE and entry.hits >= self.config.selective_min_hits)

    def admit_to_disk(self, pages: list[tuple[PageEntry, np.ndarray | None]]
                      ) -> tuple[list[tuple[PageEntry, np.ndarray | None]], dict[bytes, str]]:
        """The pages the disk policy admits (each counted as a miss there), and why the others
        were refused."""
        on_miss, admit = admission_hooks(self.policy(Tier.DISK, pages[0][0].namespace))
        admitted = []
        refused: dict[bytes, str] = {}
        for entry, source in pages:
            if on_miss is not None:
                on_miss(entry.scoped_key)
            if admit is None or admit(entry.scoped_key, entry.parent):
                admitted.append((entry, source))
            else:
                refused[entry.key] = "the disk policy did not admit this page"
        return admitted, refused

    def commit_disk_writes(self, written: list[PageEntry], checksum_by_key: dict[bytes, int | None]
                           ) -> list[PageEntry]:
        """Make durable disk copies READY; return those of pages deleted meanwhile, EVICTING,
        for the caller's `drop_from_disk`."""
        doomed = []
        for entry in written:
            assert entry.disk is not None
            entry.checksum = checksum_by_key[entry.scoped_key]
            entry.disk.state = PageState.READY
            self._tier_counters[Tier.DISK].bytes_written += entry.namespace.page_bytes
            if entry.deleted:
                entry.disk.state = PageState.EVICTING
                doomed.append(entry)
            else:
                self.track_ready(entry, Tier.DISK)
        return doomed

    def forget_dropped(self, entries: list[PageEntry]) -> None:
        """Free the slots of disk copies removed from the index; forget pages left nowhere."""
        for entry in entries:
            assert entry.disk is not None and entry.disk.state is PageState.EVICTING
            self.release(entry, Tier.DISK)
            if entry.host is None and entry.hbm is None and not entry.deleted:
                del self._table[entry.scoped_key]
                entry.deleted = True

    def pending_demotions(self) -> list[PageEntry]:
        """The pages the write policy would demote to disk that have no disk copy yet, and a
        READY copy in host or hbm (what a clean shutdown writes)."""
        ready = PageState.READY
        return [e for e in self._table.values() if self.should_demote(e) and (
            (e.host is not None and e.host.state is ready)
            or (e.hbm is not None and e.hbm.state is ready))]

    def release(self, entry: PageEntry, tier: Tier) -> None:
        residency = entry.residency(tier)
        if residency is None:
            return
        self._slots(tier).free(residency.slot, self._slot_bytes(tier, entry.namespace))
        self._page_at[tier].pop(residency.slot, None)
        entry.set_residency(tier, None)
        if entry.deleted and self._detached and not _holds_slots(entry):
            self._detached.pop(id(entry), None)

    def release_writing(self, tier: Tier, entries: list[PageEntry]) -> None:
        """Free the WRITING slots of `entries` in `tier` after a failed copy."""
        for entry in entries:
            residency = entry.residency(tier)
            if residency is not None and residency.state is PageState.WRITING:
                self.release(entry, tier)

    def best_tier(self, scoped_key: bytes) -> Tier | None:
        """The fastest tier with a READY copy of the page, or None."""
        entry = self._table.get(scoped_key)
        return entry.best_tier() if entry is not None else None

    def unlink(self, fingerprint: bytes, keys: list[bytes]) -> tuple[int, list[PageEntry]]:
        """Take `keys` out of the table and their policies, freeing idle host slots.

        Returns how many were present, and the entries whose disk copy the caller must drop
        (now EVICTING). Slots being written, evicted or read are freed by their owner or last
        reader, which sees the entry is deleted.
        """
        num_removed = 0
        to_drop = []
        for key in keys:
            entry = self._table.pop(fingerprint + key, None)
            if entry is None:
                continue
            num_removed += 1
            entry.deleted = True
            host, disk, hbm = entry.host, entry.disk, entry.hbm
            if hbm is not None and hbm.state is PageState.READY:
                self.policies[Tier.HBM].on_remove(entry.scoped_key)
                if hbm.readers == 0:
                    self.release(entry, Tier.HBM)
            if host is not None and host.state is PageState.READY:
                self.policies[Tier.HOST].on_remove(entry.scoped_key)
                if host.readers == 0:
                    self.release(entry, Tier.HOST)
            if disk is not None and disk.state is PageState.READY:
                self.policies[Tier.DISK].on_remove(entry.scoped_key)
                if disk.readers == 0:
                    disk.state = PageState.EVICTING
                    to_drop.append(entry)
            if _holds_slots(entry):
                self._detached[id(entry)] = entry
        return num_removed, to_drop

    def check(self, verify_bytes: bool) -> list[str]:
        """The integrity walk behind `PageStore.check` (see `kvtier.store.integrity`)."""
        tiers = [TierView(tier, slots, self.policies.get(tier), partial(self._slot_bytes, tier),
                          self._page_at[tier])
                 for tier, slots in self.slot_allocators()]
        host_bytes = self.host_view if self.config.with_bytes else None
        return check_pages(self._table, list(self._detached.values()), tiers, self.disk,
                           host_bytes, verify_bytes)

    def host_view(self, entry: PageEntry) -> np.ndarray:
        """The host slot of `entry` as a uint8 view (a store with bytes only)."""
        return self.host.view(entry.residency_in(Tier.HOST).slot, entry.namespace.page_bytes)

    def close(self) -> None:
        """Persist disk access data and release the tiers (after `Cascade.demote_at_close`)."""
        if self.disk is not None:
            self.disk.save_access([
                DiskRecord(e.scoped_key, disk.slot, e.namespace.page_bytes, e.checksum,
                           e.last_access_s, e.hits)
                for e in self._table.values()
                if (disk := e.disk) is not None and disk.state is PageState.READY
            ])
        self._store_tiers.close()


def admission_hooks(policy: EvictionPolicy) -> tuple[Callable | None, Callable | None]:
    """The policy's `on_miss` and `admit`, or None for each one it does not override.

    Hot loops skip the call when None: most policies admit everything and learn nothing on a miss.
    """
    policy_class = type(policy)
    on_miss = policy.on_miss if policy_class.on_miss is not EvictionPolicy.on_miss else None
    admit = policy.admit if policy_class.admit is not EvictionPolicy.admit else None
    return on_miss, admit


def _holds_slots(entry: PageEntry) -> bool:
    return entry.host is not None or entry.disk is not None or entry.hbm is not None
