"""Remote pages: how a page is named and framed as one Redis or Valkey value.

A page is stored as one value: the disk tier's 64-byte header (magic, version, namespace, key,
length, xxh3 checksum) followed by the payload, under `<prefix>:<fingerprint hex>:<key hex>`, so
pages of different models never meet and every value read back is verified before it is served.

Verbs: `redis_key`, `frame_page`, `unframe_page`.
"""

from __future__ import annotations

import numpy as np

from kvtier.tiers.page_format import (
    HEADER,
    HEADER_BYTES,
    pack_header,
    payload_checksum,
    verify_page,
)


def redis_key(key_prefix: str, scoped_key: bytes) -> str:
    """The Redis key of a page: prefix, namespace fingerprint, key."""
    return f"{key_prefix}:{scoped_key[:16].hex()}:{scoped_key[16:].hex()}"


def frame_page(scoped_key: bytes, payload: np.ndarray | memoryview | bytes,
               checksum: int | None = None) -> bytes:
    """The value stored for a page: header then payload (one copy of the payload)."""
    # numpy's stubs do not declare the buffer protocol an ndarray implements.
    view = memoryview(payload).cast("B")  # type: ignore[arg-type]
    if checksum is None:
        checksum = payload_checksum(view)
    return pack_header(scoped_key, len(view), checksum) + view


def unframe_page(value: bytes, scoped_key: bytes, payload_bytes: int) -> tuple[memoryview | None,
                                                                                  str | None]:
    """The verified payload of a stored value, or None and what is wrong with it."""
    if len(value) != HEADER_BYTES + payload_bytes:
        return None, f"value of {len(value)} bytes for a {payload_bytes}-byte page"
    checksum = HEADER.unpack_from(value)[-1]
    problem = verify_page(memoryview(value), scoped_key, payload_bytes, checksum)
    if problem is not None:
        return None, problem
    return memoryview(value)[HEADER_BYTES:], None
