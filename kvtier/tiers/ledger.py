"""A disk tier without a disk: slot accounting and an in-memory index, for trace replay.

It answers the same verbs as `DiskTier` so the store's placement, eviction and policies run
unchanged in metadata-only mode (`StoreConfig(with_bytes=False)`), where no page bytes exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvtier.keys import Namespace
from kvtier.tiers.disk import DISK_ALIGNMENT, DiskRead, DiskRecord, DiskWrite
from kvtier.tiers.page_format import HEADER_BYTES
from kvtier.tiers.slots import SlabAllocator


class DiskLedger:
    """Disk-tier bookkeeping with no files: capacity in slots, index in a dict."""

    def __init__(self, path: Path, capacity_bytes: int, chunk_bytes: int) -> None:
        self.path = Path(path)
        self.slots = SlabAllocator(capacity_bytes, chunk_bytes, DISK_ALIGNMENT)
        self._index: dict[bytes, DiskRecord] = {}

    @property
    def capacity_bytes(self) -> int:
        """Bytes of slots the tier may hold."""
        return self.slots.capacity_bytes

    def slot_bytes_for(self, payload_bytes: int) -> int:
        """Size of the slot a page of `payload_bytes` would take on disk, header included."""
        return self.slots.slot_bytes_for(HEADER_BYTES + payload_bytes)

    def recover(self, page_bytes_by_fingerprint: dict[bytes, int]) -> list[DiskRecord]:
        """Nothing survives a ledger: it starts empty."""
        return []

    def remember_namespace(self, namespace: Namespace) -> None:
        """Namespaces need no persistence here."""

    def forget_namespaces(self, fingerprints: Sequence[bytes]) -> None:
        """Namespaces need no persistence here."""

    def namespaces(self) -> list[Namespace]:
        """None: a ledger starts empty."""
        return []

    def write_pages(self, writes: Sequence[DiskWrite],
                    overlap: Callable[[], None] | None = None,
                    before_run: Callable[[list[DiskWrite]], None] | None = None) -> None:
        """Index `writes` (no bytes are written); call `before_run` with them all, then
        `overlap()`, once each."""
        if before_run is not None and writes:
            before_run(list(writes))
        if overlap is not None:
            overlap()
        for w in writes:
            self._index[w.scoped_key] = DiskRecord(w.scoped_key, w.slot, 0, w.checksum, 0.0, 0)

    def read_pages(self, reads: Sequence[DiskRead]) -> dict[bytes, str]:
        """Every read succeeds: there are no bytes to verify."""
        return {}

    def remove(self, keys_and_slots: Sequence[tuple[bytes, int]]) -> None:
        """Forget the index records of these (scoped key, slot) pairs."""
        for scoped_key, slot in keys_and_slots:
            record = self._index.get(scoped_key)
            if record is not None and record.slot == slot:
                del self._index[scoped_key]

    def records(self) -> Iterator[DiskRecord]:
        """Every indexed page."""
        return iter(list(self._index.values()))

    def save_access(self, records: Sequence[DiskRecord]) -> None:
        """Access data is not kept."""

    def sync_index(self) -> None:
        """Nothing is persisted."""

    def close(self) -> None:
        """Nothing to release."""
