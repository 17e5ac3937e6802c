"""The integrity walk: every way the page table, slot accounting, policies and disk can disagree.

`check_pages` returns a list of problems, empty when the store is sound. Tests run it after every
scenario and fault; the daemon serves it as the `check` verb, on a busy store too. It checks:
each slot used by one page and inside its tier, allocator counts equal to the pages' slots (with
those of deleted pages a copy in flight still holds: their owner frees them), every READY page
tracked by its tier's policy, the disk index naming exactly the table's disk copies, and with
`verify_bytes` every disk page's header and checksum and every host page whose checksum is known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from kvtier.keys import Namespace
from kvtier.policies import EvictionPolicy
from kvtier.store.pages import PageEntry, PageState, Tier
from kvtier.tiers.base import DiskStorage
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.page_format import payload_checksum, verify_page
from kvtier.tiers.slots import SlabAllocator


@dataclass(slots=True, frozen=True)
class TierView:
    """What the walk needs of one tier."""

    tier: Tier
    slots: SlabAllocator
    policy: EvictionPolicy | None
    slot_bytes: Callable[[Namespace], int]
    page_at: dict[int, PageEntry]  # the tier's pages by slot, as placement keeps them


def check_pages(table: dict[bytes, PageEntry], detached: list[PageEntry],
                tiers: list[TierView], disk: DiskStorage | None,
                host_bytes: Callable[[PageEntry], np.ndarray] | None,
                verify_bytes: bool) -> list[str]:
    """Every problem found; empty when sound. `detached`: deleted pages whose slots copies in
    flight still hold (counted in the slot accounting only). `host_bytes` is None without page
    bytes."""
    problems: list[str] = []
    for view in tiers:
        problems += _check_tier(table, detached, view, disk, host_bytes, verify_bytes)
    if disk is not None:
        problems += _check_disk_index(table, disk)
    for entry in detached:
        if entry.host is None and entry.disk is None and entry.hbm is None:
            problems.append(f"deleted page {entry.scoped_key.hex()} holds no slot but is still "
                            f"counted as holding one")
    for scoped_key, entry in table.items():
        if entry.scoped_key != scoped_key or entry.deleted:
            problems.append(f"table entry {scoped_key.hex()} is stale or misfiled")
        if entry.pins < 0:
            problems.append(f"page {scoped_key.hex()} has {entry.pins} pins")
    return problems


def _check_tier(table: dict[bytes, PageEntry], detached: list[PageEntry], view: TierView,
                disk: DiskStorage | None,
                host_bytes: Callable[[PageEntry], np.ndarray] | None,
                verify_bytes: bool) -> list[str]:
    problems: list[str] = []
    tier, slots, policy, label = view.tier, view.slots, view.policy, view.tier.label
    owners: dict[int, bytes] = {}
    used_bytes = 0
    num_ready = num_tracked = 0
    for entry in chain(table.values(), detached):
        residency = entry.residency(tier)
        if residency is None:
            continue
        slot_bytes = view.slot_bytes(entry.namespace)
        used_bytes += slot_bytes
        if residency.slot in owners:
            problems.append(f"{label} slot {residency.slot} is used by two pages")
        owners[residency.slot] = entry.scoped_key
        if residency.slot + slot_bytes > slots.capacity_bytes:
            problems.append(f"{label} slot {residency.slot} is beyond the capacity")
        if residency.filed:  # being written, already in its policy (kvtier.store.filing)
            num_tracked += 1
            if policy is None or entry.scoped_key not in policy:
                problems.append(f"{label} page {entry.scoped_key.hex()} is marked filed but "
                                f"not tracked by the {label} policy")
        if entry.deleted:
            if residency.state is PageState.READY and not residency.readers:
                problems.append(f"deleted {label} page {entry.scoped_key.hex()} holds an idle "
                                f"slot")
            continue  # its policy let it go at the delete; its copy's owner frees the slot
        if residency.state is PageState.READY:
            num_ready += 1
            num_tracked += 1
            if policy is None or entry.scoped_key not in policy:
                problems.append(f"{label} page {entry.scoped_key.hex()} is not tracked by the "
                                f"{label} policy")
            if verify_bytes and host_bytes is not None:
                problem = _verify_bytes(tier, entry, disk, host_bytes)
                if problem:
                    problems.append(f"{label} page {entry.scoped_key.hex()}: {problem}")
    if {slot: entry.scoped_key for slot, entry in view.page_at.items()} != owners:
        problems.append(f"{label} pages by slot disagree with the pages' slots")
    if used_bytes != slots.used_bytes or len(owners) != slots.num_used:
        problems.append(f"{label} accounting: pages use {used_bytes} bytes in {len(owners)} "
                        f"slots, allocator says {slots.used_bytes} in {slots.num_used}")
    if slots.used_bytes > slots.capacity_bytes:
        problems.append(f"{label} holds {slots.used_bytes} bytes over its capacity "
                        f"{slots.capacity_bytes}")
    if policy is not None and len(policy) != num_tracked:
        problems.append(f"{label} policy tracks {len(policy)} pages, {num_ready} are ready"
                        + (f" and {num_tracked - num_ready} filed while being written"
                           if num_tracked > num_ready else ""))
    return problems


def _verify_bytes(tier: Tier, entry: PageEntry, disk: DiskStorage | None,
                  host_bytes: Callable[[PageEntry], np.ndarray]) -> str | None:
    page_bytes = entry.namespace.page_bytes
    if tier is Tier.HBM:
        return None  # promoted from a host copy; reading device memory back is not worth it
    if tier is Tier.HOST:
        if entry.checksum is None:
            return None
        actual = payload_checksum(host_bytes(entry))
        return None if actual == entry.checksum else "host bytes differ from their checksum"
    assert isinstance(disk, DiskTier)
    if entry.checksum is None:
        return "a disk page without a checksum"
    raw = disk.read_slot(entry.residency_in(Tier.DISK).slot, page_bytes)
    return verify_page(memoryview(raw), entry.scoped_key, page_bytes, entry.checksum)


def _check_disk_index(table: dict[bytes, PageEntry], disk: DiskStorage) -> list[str]:
    problems = []
    indexed: set[tuple[bytes, int]] = set()
    for record in disk.records():
        indexed.add((record.scoped_key, record.slot))
        entry = table.get(record.scoped_key)
        if entry is None or entry.disk is None or entry.disk.slot != record.slot:
            problems.append(f"disk index names {record.scoped_key.hex()} in slot {record.slot}, "
                            f"which the table does not")
        elif entry.disk.state is not PageState.WRITING and entry.checksum != record.checksum:
            # A write in flight commits its record before the table learns the checksum.
            problems.append(f"disk index and table disagree on {record.scoped_key.hex()}")
    for scoped_key, entry in table.items():
        if entry.disk is not None and entry.disk.state is PageState.READY and (
                (scoped_key, entry.disk.slot) not in indexed):
            problems.append(f"disk page {scoped_key.hex()} is ready but not indexed")
    return problems
