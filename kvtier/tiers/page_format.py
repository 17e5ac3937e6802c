"""The on-disk page format: a 64-byte header, then the payload.

Header fields: magic, format version, header size, namespace fingerprint, key, payload length and
the payload's xxh3-64 checksum. Every read is verified against the index's own record of the page,
so a torn write, a flipped bit or a slot that holds another page's bytes is caught before serving.
Verbs: `pack_header`, `verify_page`, `payload_checksum`.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

MAGIC = b"KVTIERPG"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHI16s16sQQ")
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 64
# The same layout with fingerprint and key as one field: packing skips two slices per page.
_HEADER_WHOLE_KEY = struct.Struct("<8sHHI32sQQ")


def payload_checksum(payload: memoryview | bytes | np.ndarray) -> int:
    """xxh3-64 of a page payload: integrity against corruption, at memory speed."""
    # numpy's stubs do not declare the buffer protocol an ndarray implements.
    return xxhash.xxh3_64_intdigest(payload)  # type: ignore[arg-type]


def pack_header(scoped_key: bytes, payload_bytes: int, checksum: int) -> bytes:
    """The header for a page; `scoped_key` is the namespace fingerprint followed by the key."""
    return _HEADER_WHOLE_KEY.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, 0, scoped_key,
                                  payload_bytes, checksum)


def verify_page(slot_bytes: memoryview, scoped_key: bytes, payload_bytes: int,
                checksum: int) -> str | None:
    """Check a slot read from disk against what the index says it holds.

    Returns None when sound, else one sentence naming what is wrong.
    """
    if len(slot_bytes) < HEADER_BYTES + payload_bytes:
        return f"short read: {len(slot_bytes)} bytes for a {payload_bytes}-byte page"
    magic, version, header_bytes, _, fingerprint, key, length, stored_checksum = HEADER.unpack_from(
        slot_bytes
    )
    if magic != MAGIC:
        return "bad magic: the slot does not hold a kvtier page"
    if version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        return f"unsupported page format version {version}"
    if fingerprint + key != scoped_key:
        return "the slot holds another page (namespace or key mismatch)"
    if length != payload_bytes:
        return f"length mismatch: header says {length}, index says {payload_bytes}"
    if stored_checksum != checksum:
        return "checksum in header differs from the index"
    actual = payload_checksum(slot_bytes[HEADER_BYTES : HEADER_BYTES + payload_bytes])
    if actual != checksum:
        return f"payload checksum mismatch ({actual:016x} != {checksum:016x})"
    return None
