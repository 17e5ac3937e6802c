"""Keys and namespaces: what names a page and what makes two pages incompatible.

- `Namespace`: model id, dtype, layout, page_tokens, page_bytes and tensor-parallel rank/size, with
  a stable 16-byte `fingerprint`. Pages of different namespaces never mix.
- `prefix_keys(namespace, token_ids)`: the chained prefix hash for engines without their own
  (key_i = H(namespace, key_{i-1}, tokens_i)); deterministic across processes and runs.
- `check_keys(keys)`: validates engine-supplied opaque keys (16 bytes each).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import msgspec
import numpy as np

from kvtier.errors import ProtocolError

KEY_BYTES = 16
# blake2b, not xxhash: a key collision would serve one prompt's KV for another, and prompts come
# from users, so the hash must resist crafted collisions.
_KEY_PERSON = b"kvtier-page-key"


def _blake16(*parts: bytes | memoryview) -> bytes:
    digest = hashlib.blake2b(digest_size=KEY_BYTES, person=_KEY_PERSON)
    for part in parts:
        digest.update(part)
    return digest.digest()


@dataclass(slots=True, frozen=True)
class Namespace:
    """Everything that makes two pages incompatible; `page_bytes` is fixed per namespace.

    Args:
        model_id: the engine's model name or path.
        dtype: element type of the KV cache, e.g. "bfloat16".
        layout: the engine's page layout name, e.g. "vllm-flash" or "page-first".
        page_tokens: tokens per page.
        page_bytes: bytes of one page across all layers of this shard.
        tp_rank: tensor-parallel rank of the shard.
        tp_world_size: tensor-parallel world size.
    """

    model_id: str
    dtype: str
    layout: str
    page_tokens: int
    page_bytes: int
    tp_rank: int = 0
    tp_world_size: int = 1
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ProtocolError("namespace model_id must not be empty")
        if self.page_tokens < 1:
            raise ProtocolError(f"page_tokens must be at least 1, got {self.page_tokens}")
        if self.page_bytes < 1:
            raise ProtocolError(f"page_bytes must be at least 1, got {self.page_bytes}")
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ProtocolError(
                f"tp_rank {self.tp_rank} is outside tp_world_size {self.tp_world_size}"
            )
        # msgpack of the field tuple: unambiguous, unlike joining strings with a separator.
        canonical = msgspec.msgpack.encode(
            (self.model_id, self.dtype, self.layout, self.page_tokens, self.page_bytes,
             self.tp_rank, self.tp_world_size)
        )
        object.__setattr__(self, "fingerprint", _blake16(b"ns", canonical))

    @property
    def fingerprint_hex(self) -> str:
        """The fingerprint as 32 hex digits, for logs and file names."""
        return self.fingerprint.hex()


def prefix_keys(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    parent_key: bytes | None = None,
) -> list[bytes]:
    """Return the chained keys of every full page of `token_ids`.

    The key of page i hashes the namespace fingerprint, the key of page i-1 and the token ids of
    page i as little-endian int64, so a key names the whole prefix up to its page. A trailing
    partial page has no key: it is rarely reused and its KV is still growing.

    Args:
        namespace: the pages' namespace.
        token_ids: the prompt's token ids.
        parent_key: key of the page just before `token_ids[0]`, to continue a chain.
    """
    tokens = np.ascontiguousarray(token_ids, dtype="<i8")
    num_pages = len(tokens) // namespace.page_tokens
    pages = tokens[: num_pages * namespace.page_tokens].reshape(num_pages, namespace.page_tokens)
    previous = parent_key if parent_key is not None else b""
    keys: list[bytes] = []
    for page_tokens in pages:
        previous = _blake16(namespace.fingerprint, previous, page_tokens.data)
        keys.append(previous)
    return keys


def check_keys(keys: Iterable[object]) -> list[bytes]:
    """Return `keys` as a list of bytes, each exactly 16 bytes long.

    Raises:
        ProtocolError: a key is not bytes or has the wrong length (the message says which).
    """
    checked = list(keys)
    # Fast path for the common case; the loop below only runs to name the bad key.
    if all(type(key) is bytes and len(key) == KEY_BYTES for key in checked):
        return cast(list[bytes], checked)  # each one checked just above
    for index, key in enumerate(checked):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            shown = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
            raise ProtocolError(f"key #{index} must be {KEY_BYTES} bytes, got {shown}")
    return cast(list[bytes], checked)  # the loop raised on any other
