"""Wire messages of the control socket: typed, versioned msgspec structs.

Every request carries `id` (>= 1, chosen by the client) and its reply echoes it, so a client may
have many requests in flight on one connection. A frame that cannot be decoded gets an `Error`
reply with id 0. Requests are a tagged union on the `verb` field; replies on `reply`.
Bump `PROTOCOL_VERSION` on any incompatible change; `hello` checks it.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1
# An Error code: the register_pool frame's descriptor was dropped (read by a plain read); the
# daemon now reads with recvmsg, and the client sends the frame and its descriptor again.
RESEND_DESCRIPTOR = "resend_descriptor"
MAX_KEYS_PER_REQUEST = 65_536  # a 1M-token request in 16-token pages


class NamespaceSpec(msgspec.Struct, frozen=True):
    """A namespace on the wire; see `kvtier.keys.Namespace`."""

    model_id: str
    dtype: str
    layout: str
    page_tokens: int
    page_bytes: int
    tp_rank: int = 0
    tp_world_size: int = 1


class LayoutSpec(msgspec.Struct, frozen=True):
    """A pool layout on the wire; see `kvtier.pools.layout.PoolLayout`."""

    num_pages: int
    num_layers: int
    page_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_stride_bytes: int
    layer_stride_bytes: int
    kv_stride_bytes: int
    offset_bytes: int = 0


class _Request(msgspec.Struct, tag_field="verb", forbid_unknown_fields=True):
    id: int


class Hello(_Request, tag="hello"):
    version: int
    client_name: str = ""


class Ping(_Request, tag="ping"):
    pass


class RegisterPool(_Request, tag="register_pool", omit_defaults=True):
    # omit_defaults: a pool registered by name reads as it did before `descriptor` existed
    namespace: NamespaceSpec
    segment: str  # name under /dev/shm of the client's pool segment ("" for a GPU pool)
    layout: LayoutSpec
    cuda_ipc_handle: bytes | None = None  # a GPU pool: its CUDA IPC handle instead of a segment
    cuda_device: int = 0
    size_bytes: int = 0  # a GPU pool's size (a segment's size is read from the segment)
    cuda_ipc_offset: int = 0  # where a GPU pool starts in the allocation the handle maps
    cuda_pci_bus_id: str = ""  # a GPU pool's GPU by address: indices differ between processes
    # The pool is a sealed memfd sent with this frame (SCM_RIGHTS); `segment` then only names it.
    descriptor: bool = False


class OpenNamespace(_Request, tag="open_namespace"):
    """A handle on a namespace with no pool memory: for lookup, prefetch, pin and delete from a
    process that holds no pages (an engine's scheduler). Answered with a `PoolReply`."""

    namespace: NamespaceSpec


class UnregisterPool(_Request, tag="unregister_pool"):
    pool: int


class Lookup(_Request, tag="lookup"):
    pool: int
    keys: list[bytes]


class LookupIndex(_Request, tag="lookup_index"):
    """Where the namespace of handle `pool` has its read-only key index (the lookup plane)."""

    pool: int


class Store(_Request, tag="store"):
    pool: int
    keys: list[bytes]
    page_ids: list[int]
    parent_key: bytes | None = None


class Recall(_Request, tag="recall"):
    pool: int
    keys: list[bytes]
    page_ids: list[int]


class Rotate(_Request, tag="rotate"):
    """Swap pool pages `out_page_ids` out under `out_keys` and `in_keys` into `in_page_ids`."""

    pool: int
    out_keys: list[bytes]
    out_page_ids: list[int]
    in_keys: list[bytes]
    in_page_ids: list[int]
    parent_key: bytes | None = None


class Prefetch(_Request, tag="prefetch"):
    pool: int
    keys: list[bytes]


class Pin(_Request, tag="pin"):
    pool: int
    keys: list[bytes]
    ttl_s: float


class Unpin(_Request, tag="unpin"):
    lease: int


class Delete(_Request, tag="delete"):
    pool: int
    keys: list[bytes]


class Stats(_Request, tag="stats"):
    pass


class Check(_Request, tag="check"):
    verify_bytes: bool = False


Request = (Hello | Ping | RegisterPool | OpenNamespace | UnregisterPool | Lookup | LookupIndex
           | Store | Recall | Rotate | Prefetch | Pin | Unpin | Delete | Stats | Check)


class _Reply(msgspec.Struct, tag_field="reply"):
    id: int


class Error(_Reply, tag="error"):
    code: str
    message: str


class HelloReply(_Reply, tag="hello"):
    version: int
    server_version: str
    arena_segment: str | None  # the host arena, mappable read-only by clients
    client_id: int


class Pong(_Reply, tag="pong"):
    pass


class PoolReply(_Reply, tag="pool"):
    pool: int
    page_bytes: int


class Done(_Reply, tag="done"):
    pass


class LookupTiersReply(_Reply, tag="lookup"):
    """A lookup's answer on the wire (the client hands it out as `kvtier.client.LookupReply`)."""

    num_prefix: int
    tiers: list[str | None]  # per key: "hbm", "host", "disk", or None when absent


class LookupIndexReply(_Reply, tag="lookup_index"):
    """The index is the daemon's file descriptor `fd`, a sealed memfd of `size_bytes` bytes
    holding generation `generation`: open `/proc/<daemon pid>/fd/<fd>` read-only."""

    fd: int
    generation: int
    size_bytes: int


class JobReply(_Reply, tag="job"):
    """Completion of a store, recall or prefetch: exactly which keys did not make it."""

    num_done: int
    failed_keys: list[bytes]
    failed_reasons: list[str]
    missing_keys: list[bytes] = []
    tiers: list[str | None] = []  # recall: where each key was served from


class RotateReply(_Reply, tag="rotate"):
    """Completion of a rotate: its swap-out as a store, its swap-in as a recall."""

    num_stored: int
    store_failed_keys: list[bytes]
    store_failed_reasons: list[str]
    num_recalled: int
    recall_failed_keys: list[bytes]
    recall_failed_reasons: list[str]
    missing_keys: list[bytes]
    tiers: list[str | None]  # where each swapped-in key was served from


class PinReply(_Reply, tag="pin"):
    lease: int
    num_pinned: int
    missing_keys: list[bytes]


class DeleteReply(_Reply, tag="delete"):
    num_deleted: int


class StatsReply(_Reply, tag="stats"):
    stats: dict


class CheckReply(_Reply, tag="check"):
    problems: list[str]


Reply = (Error | HelloReply | Pong | PoolReply | Done | LookupTiersReply | LookupIndexReply
         | JobReply | RotateReply | PinReply | DeleteReply | StatsReply | CheckReply)

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
