"""Rebuilding a lost disk index from the slot file, which already says what every slot holds.

Every slot starts with its page's header (namespace fingerprint, key, length, checksum). What the
slot file does not say is where its chunks' slots start (the chunk size) and what each
namespace is: `TierLayout` keeps both in a small file beside the index (`layout.json`, replaced
atomically when a namespace is remembered or forgotten), so a directory whose index is damaged
or gone gets its pages back instead of starting empty.

`scan_slot_file` walks the file chunk by chunk: the header at a chunk's start gives the slot size
of its carving, and each slot of that size is kept only if its header names a known namespace
with that namespace's page length and its payload matches the header's checksum. Pages are
named by their content, so a slot freed but not yet rewritten comes back holding the right
bytes for its key: never another page's.

Verbs: `TierLayout.load`, `TierLayout.save`, `scan_slot_file`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import KvtierError
from kvtier.keys import Namespace
from kvtier.tiers.page_format import FORMAT_VERSION, HEADER, HEADER_BYTES, MAGIC, payload_checksum
from kvtier.tiers.slots import align_up

log = logging.getLogger("kvtier.tiers.disk")

LAYOUT_FILE_NAME = "layout.json"
_NAMESPACE_FIELDS = ("model_id", "dtype", "layout", "page_tokens", "page_bytes", "tp_rank",
                     "tp_world_size")
# A progress line at most this often while scanning (a large slot file takes minutes).
PROGRESS_INTERVAL_S = 5.0
_READ_BYTES = 8 << 20


@dataclass(slots=True)
class TierLayout:
    """What a rebuild needs besides the slot file: its chunk size and the namespaces."""

    chunk_bytes: int
    namespaces: dict[bytes, Namespace] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: Path) -> TierLayout | None:
        """The layout saved in `directory`, or None when there is none or it does not read."""
        path = directory / LAYOUT_FILE_NAME
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as file:
                data = json.loads(file.read(16 << 20))
            layout = cls(int(data["chunk_bytes"]))
            for fields in data["namespaces"]:
                namespace = Namespace(**{name: fields[name] for name in _NAMESPACE_FIELDS})
                layout.namespaces[namespace.fingerprint] = namespace
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, KvtierError) as exc:
            log.warning("disk tier layout %s does not read (%s); an index lost now could not "
                        "be rebuilt", path, exc)
            return None
        return layout

    def save(self, directory: Path) -> None:
        """Replace `directory`'s layout file (written, synced, then renamed over the old)."""
        data = {"chunk_bytes": self.chunk_bytes, "namespaces": [
            {name: getattr(ns, name) for name in _NAMESPACE_FIELDS}
            for ns in self.namespaces.values()]}
        path = directory / LAYOUT_FILE_NAME
        partial = path.with_name(LAYOUT_FILE_NAME + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(json.dumps(data).encode())
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)


@dataclass(slots=True, frozen=True)
class FoundPage:
    """A verified page in the slot file."""

    scoped_key: bytes
    slot: int
    payload_bytes: int
    checksum: int


def scan_slot_file(fd: int, file_bytes: int, layout: TierLayout, alignment: int
                   ) -> Iterator[FoundPage]:
    """Every verified page of the slot file open at `fd`, chunk by chunk, with progress lines;
    a key found twice is given once (the first slot)."""
    page_bytes_by_fingerprint = {fp: ns.page_bytes for fp, ns in layout.namespaces.items()}
    chunk_bytes = layout.chunk_bytes
    num_chunks = file_bytes // chunk_bytes
    seen: set[bytes] = set()
    num_found = 0
    last_progress_s = time.monotonic()
    for chunk_id in range(num_chunks):
        if time.monotonic() - last_progress_s >= PROGRESS_INTERVAL_S:
            last_progress_s = time.monotonic()
            log.info("rebuilding the disk index: %d of %d chunks read, %d pages found",
                     chunk_id, num_chunks, num_found)
        base = chunk_id * chunk_bytes
        first = _header(os.pread(fd, HEADER_BYTES, base), page_bytes_by_fingerprint)
        if first is None:
            continue  # never written, or its first slot is not a page: nothing to trust here
        slot_bytes = align_up(HEADER_BYTES + first[1], alignment)
        for page in _chunk_pages(fd, base, chunk_bytes, slot_bytes, alignment,
                                 page_bytes_by_fingerprint):
            if page.scoped_key not in seen:
                seen.add(page.scoped_key)
                num_found += 1
                yield page


def _chunk_pages(fd: int, base: int, chunk_bytes: int, slot_bytes: int, alignment: int,
                 page_bytes_by_fingerprint: dict[bytes, int]) -> Iterator[FoundPage]:
    """The verified pages of one chunk carved into `slot_bytes` slots, read in large runs."""
    num_slots = chunk_bytes // slot_bytes
    slots_per_read = max(1, _READ_BYTES // slot_bytes)
    for first_slot in range(0, num_slots, slots_per_read):
        count = min(slots_per_read, num_slots - first_slot)
        offset = base + first_slot * slot_bytes
        run = memoryview(os.pread(fd, count * slot_bytes, offset))
        for index in range(len(run) // slot_bytes):
            view = run[index * slot_bytes : (index + 1) * slot_bytes]
            header = _header(view, page_bytes_by_fingerprint)
            if header is None:
                continue
            scoped_key, payload_bytes, checksum = header
            if align_up(HEADER_BYTES + payload_bytes, alignment) != slot_bytes:
                continue  # a stale page of an earlier carving of this chunk
            if payload_checksum(view[HEADER_BYTES : HEADER_BYTES + payload_bytes]) != checksum:
                continue  # torn or damaged: never indexed
            yield FoundPage(scoped_key, offset + index * slot_bytes, payload_bytes, checksum)


def _header(raw: bytes | memoryview, page_bytes_by_fingerprint: dict[bytes, int]
            ) -> tuple[bytes, int, int] | None:
    """(scoped key, payload bytes, checksum) of a sound header of a known namespace, or None."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, header_bytes, _, fingerprint, key, length, checksum = HEADER.unpack_from(raw)
    if (magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES
            or page_bytes_by_fingerprint.get(fingerprint) != length):
        return None
    return fingerprint + key, length, checksum
