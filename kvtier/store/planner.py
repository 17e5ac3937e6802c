"""The verbs' plans over placement: what a store creates and commits, what a recall reads.

`Planner` makes the verbs' decisions over a `Placement` it is handed: `plan_store` creates
invisible entries and routes each to host (or straight to disk when the host policy refuses it),
`commit_store` makes them READY or undoes them; `plan_recall` picks each key's source tier and
takes a reader count on it, `finish_recall` drops the counts (and the disk copies that failed
their check); `plan_promotions` picks which hits the cascade copies up (hot host hits to hbm,
disk hits to host). Like all of placement, every method expects the store's lock held and moves
no bytes. Verbs: `plan_store`, `commit_store`, `count_lookups`, `plan_recall`, `finish_recall`,
`plan_promotions`, `held_bytes`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.keys import Namespace
from kvtier.store.page_table import PageTable
from kvtier.store.pages import PageEntry, PageState, Tier
from kvtier.store.placement import Placement, admission_hooks
from kvtier.store.stats import StoreCounters

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StorePlan:
    """A store's decisions: new entries bound for host or straight to disk, and the rest."""

    to_host_indexed: list[tuple[PageEntry, int]] = field(default_factory=list)
    to_disk_indexed: list[tuple[PageEntry, int]] = field(default_factory=list)
    already_present: list[bytes] = field(default_factory=list)
    failed: dict[bytes, str] = field(default_factory=dict)

    @property
    def to_host(self) -> list[PageEntry]:
        """Entries that need a host slot."""
        return [entry for entry, _ in self.to_host_indexed]


@dataclass(slots=True)
class RecallPlan:
    """A recall's sources: entries with a reader count taken on the tier they are read from."""

    sources: dict[Tier, list[tuple[PageEntry, int]]] = field(
        default_factory=lambda: {Tier.HBM: [], Tier.HOST: [], Tier.DISK: []})
    missing: list[bytes] = field(default_factory=list)
    elsewhere: list[int] = field(default_factory=list)  # present, not in the tiers asked for
    # Per tier, in order, the scoped keys of READY hits its policy has not counted yet
    # (`Planner.count_hits`).
    hits: dict[Tier, list[bytes]] = field(default_factory=dict)

    @property
    def from_hbm(self) -> list[tuple[PageEntry, int]]:
        """(entry, index) of the keys read from hbm."""
        return self.sources[Tier.HBM]

    @property
    def from_host(self) -> list[tuple[PageEntry, int]]:
        """(entry, index) of the keys read from host."""
        return self.sources[Tier.HOST]

    @property
    def from_disk(self) -> list[tuple[PageEntry, int]]:
        """(entry, index) of the keys read from disk."""
        return self.sources[Tier.DISK]

    def split(self, kept: list[PageEntry]) -> tuple[RecallPlan, RecallPlan | None]:
        """This plan's sources as (those not of `kept`, those of `kept` or None when `kept` is
        empty): two plans whose reader counts are dropped at different times."""
        if not kept:
            return self, None
        kept_ids = {id(entry) for entry in kept}
        rest, held = RecallPlan(missing=self.missing, elsewhere=self.elsewhere), RecallPlan()
        for tier, sources in self.sources.items():
            for pair in sources:
                (held if id(pair[0]) in kept_ids else rest).sources[tier].append(pair)
        return rest, held

    def served_tiers(self, num_keys: int, failed: dict[bytes, str]) -> list[Tier | None]:
        """Where each of the `num_keys` requested keys was served from (None: it was not)."""
        tiers: list[Tier | None] = [None] * num_keys
        for tier, sources in self.sources.items():
            for entry, index in sources:
                if not failed or entry.key not in failed:
                    tiers[index] = tier
        return tiers


@dataclass(slots=True)
class PromotionPlan:
    """The hits a recall copies up: hot host hits into hbm, disk hits into host (with the
    request page each landed in, the source of its host copy)."""

    to_hbm: list[PageEntry] = field(default_factory=list)
    to_host: list[tuple[PageEntry, int]] = field(default_factory=list)

    @property
    def sources(self) -> list[PageEntry]:
        """The entries whose reader counts the promotion keeps until it is done."""
        return self.to_hbm + [entry for entry, _ in self.to_host]


class Planner:
    """The store and recall verbs' plans over `placement` (see the module docstring).

    Args:
        placement: the tiers' metadata the plans change.
        table: the page table `placement` keeps.
        counters: the store's counters (failures, promotions, integrity errors).
    """

    def __init__(self, placement: Placement, table: PageTable, counters: StoreCounters) -> None:
        self._placement = placement
        self._table = table
        self._counters = counters
        self._config = placement.config
        # Each tier with its counters, fastest first, for `count_lookups` (the tiers are fixed)
        self._lookup_counters = [(tier, placement.counters_of(tier)) for tier in placement.tiers]

    def plan_store(self, namespace: Namespace, keys: list[bytes],
                   parent_key: bytes | None = None) -> StorePlan:
        """Create invisible entries for new keys and route each to host, or disk if host refuses."""
        plan = StorePlan()
        fingerprint = namespace.fingerprint
        host_policy = self._placement.policy(Tier.HOST, namespace)
        table = self._table
        to_host = plan.to_host_indexed
        now = time.time()
        # Each key's parent is the key before it: its scoped form is the one made last round.
        parent = fingerprint + parent_key if parent_key is not None else None
        for index, key in enumerate(keys):
            scoped_key = fingerprint + key
            if scoped_key in table:
                plan.already_present.append(key)
            else:
                entry = PageEntry(scoped_key, namespace)  # keywords cost a third more
                entry.parent, entry.last_access_s = parent, now
                table[scoped_key] = entry
                to_host.append((entry, index))
            parent = scoped_key
        # One policy call for the run; none where the policy admits all and learns nothing.
        if to_host and admission_hooks(host_policy) != (None, None):
            admitted = host_policy.admit_many([(entry.scoped_key, entry.parent)
                                               for entry, _ in to_host])
            if not all(admitted):
                self._route_refused(plan, admitted)
        return plan

    def _route_refused(self, plan: StorePlan, admitted: list[bool]) -> None:
        """Send the pages the host policy refused to disk, or fail them without one."""
        to_host, plan.to_host_indexed = plan.to_host_indexed, []
        for (entry, index), entered in zip(to_host, admitted):
            if entered:
                plan.to_host_indexed.append((entry, index))
            elif self._placement.disk is not None:
                plan.to_disk_indexed.append((entry, index))
            else:
                del self._table[entry.scoped_key]
                plan.failed[entry.key] = ("the host policy did not admit this page "
                                          "and there is no disk tier")

    def file_early(self, entries: list[PageEntry]) -> None:
        """Hand the host policy the pages of a wave still being copied (`kvtier.store.filing`):
        each WRITING host copy not deleted meanwhile is marked `filed`, and `commit_store`
        inserts it no more."""
        run = []
        for entry in entries:
            host = entry.host
            if host is not None and host.state is PageState.WRITING and not entry.deleted:
                host.filed = True
                run.append((entry.scoped_key, entry.parent))
        if run:
            self._placement.policy(Tier.HOST, entries[0].namespace).on_insert_many(run)

    def commit_store(self, indexed: list[tuple[PageEntry, int]],
                     failed: dict[bytes, str]) -> tuple[list[bytes], list[PageEntry]]:
        """Make stored entries READY; undo the entries whose store failed.

        Returns the stored keys, and the entries whose disk copy the caller must drop
        (`drop_from_disk`) because they were deleted while being stored.
        """
        stored: list[bytes] = []
        to_drop: list[PageEntry] = []
        ready = PageState.READY
        host_policy = self._placement.policies.get(Tier.HOST)
        ready_entries: list[PageEntry] = []  # for the page table's observer in one call
        num_failed = host_bytes = 0
        inserted: list[tuple[bytes, bytes | None]] = []  # for the policy in one call
        for entry, _ in indexed:
            key = entry.scoped_key[16:]
            host = entry.host
            if entry.deleted or (failed and key in failed):
                num_failed += key in failed
                if host is not None and host.filed:  # filed while copied: the policy lets go
                    assert host_policy is not None
                    host_policy.on_remove(entry.scoped_key)
                    host.filed = False
                if self._abandon(entry):
                    to_drop.append(entry)
                continue
            if host is not None:
                host.state = ready
                ready_entries.append(entry)
                if host.filed:
                    host.filed = False
                else:
                    inserted.append((entry.scoped_key, entry.parent))
                host_bytes += entry.namespace.page_bytes
            stored.append(key)
        self._table.pages_ready(ready_entries)
        if inserted:
            assert host_policy is not None  # plan_store made it for these host residencies
            host_policy.on_insert_many(inserted)
        self._placement.counters_of(Tier.HOST).bytes_written += host_bytes
        self._counters.store_failures += num_failed
        return stored, to_drop

    def _abandon(self, entry: PageEntry) -> bool:
        """Undo an entry whose store failed or that was deleted while being stored.

        Returns True when its durable disk copy must go too (marked EVICTING for the caller's
        `drop_from_disk`): the entry was deleted after its disk write.
        """
        for tier in (Tier.HOST, Tier.DISK):
            residency = entry.residency(tier)
            if residency is not None and residency.state is PageState.WRITING:
                self._placement.release(entry, tier)
        disk = entry.disk
        if disk is not None and disk.state is PageState.READY:
            # Durable already: the page stays on disk unless it was deleted.
            if entry.deleted and disk.readers == 0:
                disk.state = PageState.EVICTING
                return True
            return False
        if not entry.deleted:
            self._table.pop(entry.scoped_key, None)
            entry.deleted = True
        return False

    def count_lookups(self, tiers: list[Tier | None]) -> None:
        """Count one hit or miss per key in the first tier, and in each next one per miss."""
        for found in tiers:
            for tier, tier_counters in self._lookup_counters:
                if found is tier:
                    tier_counters.hits += 1
                    break
                tier_counters.misses += 1

    def plan_recall(self, namespace: Namespace, keys: list[bytes],
                    from_tiers: tuple[Tier, ...] | None = None,
                    count_hits: bool = True) -> RecallPlan:
        """Pick each key's source tier and take a reader count on it; the policies count the
        hits now, or, without `count_hits`, at the caller's `count_hits(plan)`.

        With `from_tiers`, keys whose fastest tier is another one are only listed (by index) in
        `elsewhere`: no reader count, no access recorded.
        """
        plan = RecallPlan()
        fingerprint = namespace.fingerprint
        hits = plan.hits
        now = time.time()
        for index, key in enumerate(keys):
            entry = self._table.get(fingerprint + key)
            tier = entry.best_tier() if entry is not None else None
            if entry is None or tier is None:
                plan.missing.append(key)
                continue
            if from_tiers is not None and tier not in from_tiers:
                plan.elsewhere.append(index)
                continue
            residency = entry.residency_in(tier)
            residency.readers += 1
            if residency.state is PageState.READY:  # not one being demoted: its policy let go
                hits.setdefault(tier, []).append(entry.scoped_key)
            entry.hits += 1
            entry.last_access_s = now
            plan.sources[tier].append((entry, index))
        if count_hits:
            self.count_hits(plan)
        return plan

    def count_hits(self, plan: RecallPlan) -> None:
        """Hand each tier's policy the hits of `plan` it has not counted, in one call. The pages
        keep their reader counts meanwhile (not evictable); a page deleted since is unknown to
        its policy, which ignores it."""
        policies = self._placement.policies  # a READY copy's tier has made its policy
        for tier, scoped_keys in plan.hits.items():
            policies[tier].on_access_many(scoped_keys)
        plan.hits = {}

    def finish_recall(self, plan: RecallPlan, failed: dict[bytes, str]) -> list[PageEntry]:
        """Drop reader counts; return disk entries to drop (corrupt, or deleted meanwhile).

        The returned entries are EVICTING, for the caller's `drop_from_disk`.
        """
        to_drop = []
        for tier, sources in plan.sources.items():
            if not sources:
                continue
            counters = self._placement.counters_of(tier)
            for entry, _ in sources:
                residency = entry.residency_in(tier)
                residency.readers -= 1
                counters.bytes_read += entry.namespace.page_bytes
                if residency.released and not residency.readers:  # its eviction is done
                    self._placement.release(entry, tier)
                    self._placement.forget_if_nowhere(entry)
                    continue
                if residency.readers or residency.state is not PageState.READY:
                    continue
                if tier is not Tier.DISK:
                    if entry.deleted:  # the last reader of a deleted page frees it
                        self._placement.release(entry, tier)
                elif entry.deleted or entry.key in failed:
                    residency.state = PageState.EVICTING
                    if not entry.deleted:  # a deleted page already left its policy
                        self._placement.policy(Tier.DISK, entry.namespace).on_remove(
                            entry.scoped_key)
                    to_drop.append(entry)
        if failed:
            self._counters.integrity_errors += len(failed)
            for key, problem in failed.items():
                log.error("integrity error: disk page %s not served: %s", key.hex(), problem)
        return to_drop

    def plan_promotions(self, plan: RecallPlan, failed: dict[bytes, str]) -> PromotionPlan:
        """The hits of `plan` that were copied out and that the policies copy up: host hits hot
        enough for hbm (`hbm.promote_hits`), and disk hits the host policy admits."""
        promotion = PromotionPlan()
        if self._placement.hbm is not None and plan.from_host:
            promotion.to_hbm = self._hot_for_hbm(
                [e for e, _ in plan.from_host if not failed or e.key not in failed])
        if plan.from_disk:
            disk_hits = [(e, i) for e, i in plan.from_disk if not failed or e.key not in failed]
            admitted = set(map(id, self._admitted(
                Tier.HOST, [e for e, _ in disk_hits if not e.deleted and e.host is None])))
            promotion.to_host = [(e, i) for e, i in disk_hits if id(e) in admitted]
        return promotion

    def _admitted(self, tier: Tier, candidates: list[PageEntry]) -> list[PageEntry]:
        """The promotion candidates `tier`'s policy admits (each counted as a miss there)."""
        admitted = []
        for entry in candidates:
            policy = self._placement.policy(tier, entry.namespace)
            policy.on_miss(entry.scoped_key)
            if policy.admit(entry.scoped_key, entry.parent):
                admitted.append(entry)
        return admitted

    def _hot_for_hbm(self, entries: list[PageEntry]) -> list[PageEntry]:
        """The host hits hot enough for hbm (`hbm.promote_hits`) that its policy admits."""
        threshold = self._config.hbm.promote_hits
        return self._admitted(Tier.HBM, [e for e in entries if not e.deleted and e.hbm is None
                                         and e.hits >= threshold])

    def held_bytes(self, entries: Iterable[PageEntry]) -> dict[Tier, int]:
        """Bytes of slots `entries` hold in each tier (what pinning them keeps from eviction)."""
        held = dict.fromkeys(self._placement.tiers, 0)
        for entry in entries:
            for tier in held:
                if entry.residency(tier) is not None:
                    held[tier] += self._placement.slot_bytes(tier, entry.namespace)
        return held
