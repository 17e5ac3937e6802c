"""Building a store's tiers from its configuration: host always, disk and hbm when enabled.

`build_tiers` opens each tier with its chunk size fitted to its capacity (`fit_chunk_bytes`, said
at start when it was lowered or leaves the tier few chunks), and closes what it opened when a
later tier fails, so a store that fails to start holds no arena. Placement maps the result to
`Tier` keys; nothing here knows pages or policies. Verbs: `build_tiers`, `StoreTiers.close`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import StoreConfig
from kvtier.sizes import format_bytes
from kvtier.tiers.base import DiskStorage
from kvtier.tiers.disk import DISK_ALIGNMENT, DiskTier
from kvtier.tiers.hbm import HBM_SLOT_ALIGNMENT, HbmTier
from kvtier.tiers.host import HOST_SLOT_ALIGNMENT, HostTier
from kvtier.tiers.ledger import DiskLedger
from kvtier.tiers.slots import MIN_CHUNKS_PER_TIER, fit_chunk_bytes

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class StoreTiers:
    """The tiers of one store: host always, disk and hbm when configured."""

    host: HostTier
    disk: DiskStorage | None
    hbm: HbmTier | None

    def close(self) -> None:
        """Release every tier (the disk first: its index may be saved from host bytes)."""
        if self.disk is not None:
            self.disk.close()
        if self.hbm is not None:
            self.hbm.close()
        self.host.close()


def build_tiers(config: StoreConfig) -> StoreTiers:
    """Open the tiers `config` asks for; without bytes, a `DiskLedger` stands in for the disk.

    Raises:
        StorageError: the arena or the disk directory cannot be created or is in use.
        CapacityError: a tier is too small for one slot.
    """
    fit = config.fit_chunks
    host = HostTier(config.host.capacity_bytes,
                    _fitted_chunk("host", config.host.capacity_bytes, config.host.chunk_bytes,
                                  HOST_SLOT_ALIGNMENT, fit),
                    with_bytes=config.with_bytes, prefault=config.host.prefault)
    disk: DiskStorage | None = None
    hbm: HbmTier | None = None
    try:
        if config.disk.enabled:
            disk_class: Callable[[Path, int, int], DiskStorage] = (
                DiskTier if config.with_bytes else DiskLedger)
            disk = disk_class(config.disk.path, config.disk.capacity_bytes,
                              _fitted_chunk("disk", config.disk.capacity_bytes,
                                            config.disk.chunk_bytes, DISK_ALIGNMENT, fit))
        if config.hbm.enabled:
            hbm = HbmTier(config.hbm.capacity_bytes,
                          _fitted_chunk("hbm", config.hbm.capacity_bytes, config.hbm.chunk_bytes,
                                        HBM_SLOT_ALIGNMENT, fit),
                          config.hbm.device, with_bytes=config.with_bytes)
    except BaseException:
        host.close()  # the arena must not outlive a store that failed to start
        if disk is not None:
            disk.close()
        raise
    return StoreTiers(host, disk, hbm)


def _fitted_chunk(label: str, capacity_bytes: int, chunk_bytes: int, alignment: int,
                  fit: bool) -> int:
    """The chunk size of tier `label` (`fit_chunk_bytes` when `fit`), said at start when it
    was lowered or leaves the tier few chunks."""
    if not fit:
        return chunk_bytes
    fitted = fit_chunk_bytes(capacity_bytes, chunk_bytes, alignment)
    if capacity_bytes < fitted:
        return chunk_bytes  # the allocator refuses a tier too small for one slot
    if fitted < min(chunk_bytes, capacity_bytes):
        log.info("%s tier: chunks of %s instead of %s, so its %s hold %d chunks and a new page "
                 "size takes at most one of them; pages over %s are refused (%s.chunk)",
                 label, format_bytes(fitted), format_bytes(chunk_bytes),
                 format_bytes(capacity_bytes), capacity_bytes // fitted, format_bytes(fitted),
                 label)
    elif capacity_bytes // fitted < MIN_CHUNKS_PER_TIER:
        log.info("%s tier: %s holds only %d chunks of %s; each page size takes a whole chunk, "
                 "so a few page sizes may evict each other's pages", label,
                 format_bytes(capacity_bytes), capacity_bytes // fitted, format_bytes(fitted))
    return fitted
