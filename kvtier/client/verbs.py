"""Each client verb's request and how to read its reply, written once for both clients.

A verb here takes the request id and the verb's arguments and returns a `Call`: the request to
send and the function that turns the daemon's reply into what the verb returns. `Client` sends
it and waits; `AsyncClient` sends it and awaits; neither builds a request itself, so the two
cannot drift apart. An error reply never reaches a parser (`raise_if_error` comes first); a
reply of the wrong kind is the daemon breaking the protocol and raises `ProtocolError`.

Verbs: `hello`, `ping`, `register_pool`, `register_sealed_pool`, `register_device_pool`,
`open_namespace`, `unregister_pool`, `lookup`, `store`, `recall`, `rotate`, `prefetch`, `pin`,
`unpin`, `delete`, `stats`, `check`; `raise_if_error`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvtier.client.results import JobResult, LookupReply, PoolHandle, RotateResult
from kvtier.errors import DaemonReplyError, ProtocolError
from kvtier.ipc import messages as m
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout

if TYPE_CHECKING:
    from kvtier.client.device_memory import DeviceMemory

R = TypeVar("R")
ReplyT = TypeVar("ReplyT", bound=m._Reply)

# The verbs both clients serve (`hello` is said once, on connecting).
CLIENT_VERBS = ("ping", "register_pool", "register_sealed_pool", "register_device_pool",
                "open_namespace", "unregister_pool", "lookup", "store", "recall", "rotate",
                "prefetch", "pin", "unpin", "delete", "stats", "check")


@dataclass(slots=True)  # not frozen: a frozen init is a tenth of a lookup's client time
class Call(Generic[R]):
    """One verb's request and the parser of its reply."""

    request: m._Request
    parse: Callable[[m._Reply], R]
    fd: int = -1  # a descriptor sent with the request's frame (SCM_RIGHTS); -1: none


def raise_if_error(reply: m._Reply) -> m._Reply:
    """`reply`, unless it is an error.

    Raises:
        DaemonReplyError: the daemon refused the request; its code and sentence.
    """
    if isinstance(reply, m.Error):
        raise DaemonReplyError(reply.code, reply.message)
    return reply


def _expect(reply: m._Reply, kind: type[ReplyT]) -> ReplyT:
    if not isinstance(reply, kind):
        raise ProtocolError(f"the daemon answered a request with a {type(reply).__name__}, "
                            f"not a {kind.__name__}")
    return reply


def _namespace_spec(namespace: Namespace) -> m.NamespaceSpec:
    return m.NamespaceSpec(namespace.model_id, namespace.dtype, namespace.layout,
                           namespace.page_tokens, namespace.page_bytes, namespace.tp_rank,
                           namespace.tp_world_size)


def _layout_spec(layout: PoolLayout) -> m.LayoutSpec:
    return m.LayoutSpec(**{f: getattr(layout, f) for f in m.LayoutSpec.__struct_fields__})


def _none(reply: m._Reply) -> None:
    return None


def _pool_handle(namespace: Namespace) -> Callable[[m._Reply], PoolHandle]:
    def parse(reply: m._Reply) -> PoolHandle:
        pool = _expect(reply, m.PoolReply)
        return PoolHandle(pool.pool, namespace, pool.page_bytes)

    return parse


def _job_result(reply: m._Reply) -> JobResult:
    job = _expect(reply, m.JobReply)
    return JobResult(job.num_done, dict(zip(job.failed_keys, job.failed_reasons)),
                     job.missing_keys, job.tiers)


def _rotate_result(reply: m._Reply) -> RotateResult:
    rotate = _expect(reply, m.RotateReply)
    return RotateResult(
        JobResult(rotate.num_stored,
                  dict(zip(rotate.store_failed_keys, rotate.store_failed_reasons)), [], []),
        JobResult(rotate.num_recalled,
                  dict(zip(rotate.recall_failed_keys, rotate.recall_failed_reasons)),
                  rotate.missing_keys, rotate.tiers))


def _page_ids(page_ids: Sequence[int]) -> list[int]:
    return [int(i) for i in page_ids]


def hello(request_id: int, client_name: str) -> Call[m.HelloReply]:
    """Say hello with our protocol version; the reply names our client id and the arena."""
    return Call(m.Hello(request_id, m.PROTOCOL_VERSION, client_name),
                lambda reply: _expect(reply, m.HelloReply))


def ping(request_id: int) -> Call[None]:
    """A round trip."""
    return Call(m.Ping(request_id), _none)


def register_pool(request_id: int, namespace: Namespace, segment_name: str,
                  layout: PoolLayout) -> Call[PoolHandle]:
    """Register the pool in shared-memory segment `segment_name`, laid out as `layout`."""
    return Call(m.RegisterPool(request_id, _namespace_spec(namespace), segment_name,
                               _layout_spec(layout)), _pool_handle(namespace))


def register_sealed_pool(request_id: int, namespace: Namespace, fd: int, layout: PoolLayout,
                         name: str = "") -> Call[PoolHandle]:
    """Register the sealed memfd `fd` as a pool (`name` for messages); `fd` rides with the frame."""
    return Call(m.RegisterPool(request_id, _namespace_spec(namespace), name, _layout_spec(layout),
                               descriptor=True), _pool_handle(namespace), fd)


def register_device_pool(request_id: int, namespace: Namespace, memory: DeviceMemory,
                         layout: PoolLayout) -> Call[PoolHandle]:
    """Register a GPU pool through its CUDA IPC handle."""
    return Call(m.RegisterPool(
        request_id, _namespace_spec(namespace), "", _layout_spec(layout),
        cuda_ipc_handle=memory.ipc_handle, cuda_device=memory.device,
        size_bytes=memory.size_bytes, cuda_ipc_offset=memory.ipc_offset,
        cuda_pci_bus_id=memory.pci_bus_id), _pool_handle(namespace))


def open_namespace(request_id: int, namespace: Namespace) -> Call[PoolHandle]:
    """A handle on `namespace` without pool memory."""
    return Call(m.OpenNamespace(request_id, _namespace_spec(namespace)), _pool_handle(namespace))


def unregister_pool(request_id: int, pool: PoolHandle) -> Call[None]:
    """Stop using a pool."""
    return Call(m.UnregisterPool(request_id, pool.pool_id), _none)


def lookup(request_id: int, pool: PoolHandle, keys: Sequence[bytes]) -> Call[LookupReply]:
    """Longest prefix of `keys` the node holds, and each key's tier."""
    return Call(m.Lookup(request_id, pool.pool_id, list(keys)), _lookup_reply)


def _lookup_reply(reply: m._Reply) -> LookupReply:
    found = _expect(reply, m.LookupTiersReply)
    return LookupReply(found.num_prefix, found.tiers)


def store(request_id: int, pool: PoolHandle, keys: Sequence[bytes], page_ids: Sequence[int],
          parent_key: bytes | None) -> Call[JobResult]:
    """Store pool pages `page_ids[i]` under `keys[i]`."""
    return Call(m.Store(request_id, pool.pool_id, list(keys), _page_ids(page_ids), parent_key),
                _job_result)


def recall(request_id: int, pool: PoolHandle, keys: Sequence[bytes],
           page_ids: Sequence[int]) -> Call[JobResult]:
    """Copy the pages of `keys` into pool pages `page_ids[i]`."""
    return Call(m.Recall(request_id, pool.pool_id, list(keys), _page_ids(page_ids)), _job_result)


def rotate(request_id: int, pool: PoolHandle, out_keys: Sequence[bytes],
           out_page_ids: Sequence[int], in_keys: Sequence[bytes], in_page_ids: Sequence[int],
           parent_key: bytes | None) -> Call[RotateResult]:
    """Swap pages out under `out_keys` and the pages of `in_keys` in, in one request."""
    return Call(m.Rotate(request_id, pool.pool_id, list(out_keys), _page_ids(out_page_ids),
                         list(in_keys), _page_ids(in_page_ids), parent_key), _rotate_result)


def prefetch(request_id: int, pool: PoolHandle, keys: Sequence[bytes]) -> Call[JobResult]:
    """Bring disk-resident pages of `keys` up to the host tier."""
    return Call(m.Prefetch(request_id, pool.pool_id, list(keys)), _job_result)


def pin(request_id: int, pool: PoolHandle, keys: Sequence[bytes],
        ttl_s: float) -> Call[tuple[int, list[bytes]]]:
    """Hold pages against eviction for `ttl_s`: (lease id, keys not present)."""
    def parse(reply: m._Reply) -> tuple[int, list[bytes]]:
        pinned = _expect(reply, m.PinReply)
        return pinned.lease, pinned.missing_keys

    return Call(m.Pin(request_id, pool.pool_id, list(keys), ttl_s), parse)


def unpin(request_id: int, lease: int) -> Call[None]:
    """Release a lease."""
    return Call(m.Unpin(request_id, lease), _none)


def delete(request_id: int, pool: PoolHandle, keys: Sequence[bytes]) -> Call[int]:
    """Remove pages from every tier: how many were present."""
    return Call(m.Delete(request_id, pool.pool_id, list(keys)),
                lambda reply: _expect(reply, m.DeleteReply).num_deleted)


def stats(request_id: int) -> Call[dict[str, Any]]:
    """The daemon's live figures."""
    return Call(m.Stats(request_id), lambda reply: _expect(reply, m.StatsReply).stats)


def check(request_id: int, verify_bytes: bool) -> Call[list[str]]:
    """The daemon's integrity walk: its problems, none when sound."""
    return Call(m.Check(request_id, verify_bytes),
                lambda reply: _expect(reply, m.CheckReply).problems)
