"""What a tier answers: the interfaces the page store and placement use, looked up by `Tier`.

Placement builds one mapping, `Tier -> SlotTier`, of the tiers a store has (hbm when configured,
host, disk when configured) and asks it for slot accounting; the byte moves go through
`kvtier.store.movers`, which reaches arenas (`ArenaTier`: host, hbm) and the disk
(`DiskStorage`: `DiskTier` with bytes, `DiskLedger` without) through these protocols. The remote
tier holds no slots here: it is only a `TierStorage`.

Protocols: `TierStorage`, `SlotTier`, `ArenaTier` (`HostArenaTier`, `DeviceArenaTier`),
`DiskStorage`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvtier.keys import Namespace
from kvtier.pools.page_access import PageAccess
from kvtier.tiers.slots import SlabAllocator

if TYPE_CHECKING:
    from kvtier.tiers.disk import DiskRead, DiskRecord, DiskWrite


class TierStorage(Protocol):
    """Any tier: something to release when the store closes."""

    def close(self) -> None:
        """Release what the tier holds (idempotent)."""


class SlotTier(TierStorage, Protocol):
    """A tier that holds pages in slots the store accounts for."""

    slots: SlabAllocator

    @property
    def capacity_bytes(self) -> int:
        """Bytes of slots the tier may hold."""

    def slot_bytes_for(self, payload_bytes: int) -> int:
        """Size of the slot a page of `payload_bytes` takes in this tier."""


class ArenaTier(SlotTier, Protocol):
    """A tier whose slots are offsets into one memory arena (host, hbm)."""

    @property
    def arena(self) -> np.ndarray | None:
        """The arena (None without bytes); a CuPy array for an hbm tier on a GPU."""

    def view(self, slot: int, num_bytes: int) -> np.ndarray | None:
        """The bytes of a slot as a host array, or None without bytes."""

    def copy_out(self, pairs: Sequence[tuple[int, int]], pages: PageAccess) -> None:
        """Slot into page `index` of `pages`, for each (slot, index) pair."""


class HostArenaTier(ArenaTier, Protocol):
    """The host tier: pages land in its arena from a request's pages."""

    def copy_in(self, pairs: Sequence[tuple[int, int]], pages: PageAccess) -> None:
        """Page `index` of `pages` into its slot, for each (slot, index) pair."""


class DeviceArenaTier(ArenaTier, Protocol):
    """The hbm tier: an arena in GPU memory (or host memory where there is no GPU) that pages
    reach from the host arena and leave to it."""

    device: int | None

    @property
    def on_device(self) -> bool:
        """Whether the arena is GPU memory."""

    @property
    def address(self) -> int:
        """The arena's first byte: a device address on a GPU, a host address otherwise."""

    def copy_from_host(self, pairs: Sequence[tuple[int, int]], host_arena: np.ndarray,
                       page_bytes: int) -> None:
        """Promotion: host arena `host_slot` into `hbm_slot`, for each (hbm_slot, host_slot)."""

    def copy_to_host(self, pairs: Sequence[tuple[int, int]], host_arena: np.ndarray,
                     page_bytes: int) -> None:
        """Demotion: `hbm_slot` into host arena `host_slot`, for each (hbm_slot, host_slot)."""


class DiskStorage(SlotTier, Protocol):
    """The disk tier's verbs: `DiskTier` (a slot file and an index) or `DiskLedger` (replay)."""

    path: Path

    def recover(self, page_bytes_by_fingerprint: dict[bytes, int]) -> list[DiskRecord]:
        """Every usable record of a previous run."""

    def remember_namespace(self, namespace: Namespace) -> None:
        """Persist `namespace`, so a restart can read its pages."""

    def forget_namespaces(self, fingerprints: Sequence[bytes]) -> None:
        """Drop namespaces that hold no pages."""

    def namespaces(self) -> list[Namespace]:
        """The persisted namespaces."""

    def write_pages(self, writes: Sequence[DiskWrite],
                    overlap: Callable[[], None] | None = None,
                    before_run: Callable[[list[DiskWrite]], None] | None = None) -> None:
        """Write and index `writes` durably; `overlap()` runs once while they are in flight,
        `before_run(run)` before each run of them is written (with all of them, at most)."""

    def read_pages(self, reads: Sequence[DiskRead]) -> dict[bytes, str]:
        """Read and verify `reads`; {scoped key: problem} for those not served."""

    def remove(self, keys_and_slots: Sequence[tuple[bytes, int]]) -> None:
        """Drop index records by (scoped key, slot)."""

    def records(self) -> Iterator[DiskRecord]:
        """Every indexed page."""

    def save_access(self, records: Sequence[DiskRecord]) -> None:
        """Persist access data (last access, hits) for the next start."""

    def sync_index(self) -> None:
        """Make every index update so far durable."""
