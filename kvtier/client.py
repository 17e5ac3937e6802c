"""Client library: attach an engine to the kvtier daemon.

`Client` (blocking) and `AsyncClient` (asyncio) speak the same verbs: `register_pool`,
`open_namespace`, `lookup`, `store`, `recall`, `rotate`, `prefetch`, `pin` / `unpin`, `delete`,
`stats`, `check`, `ping`. `store`, `recall` and `rotate` return a job at once; `job.result()`
waits for completion, which names exactly the keys that failed. `SharedPool` creates the
shared-memory segment that holds an engine's pages on a machine without a GPU. Page bytes never
travel over the socket.

Before saying hello both clients check who serves the socket (SO_PEERCRED): a server of another
uid than ours or root's could be another local user's fake, to whom registering a pool would hand
our pages. Trust a daemon run by another uid with `trusted_server_uids` or
`$KVTIER_TRUSTED_SERVER_UIDS` (comma-separated). Reply frames are capped in size like requests.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from kvtier.errors import KvtierError, ProtocolError
from kvtier.device_pools import DeviceMemory
from kvtier.ipc import messages as m
from kvtier.ipc.frames import HEADER_BYTES, FrameTooLarge, pack_frame, read_frame
from kvtier.keys import Namespace
from kvtier.pool_layout import PoolLayout
from kvtier.settings import default_socket_path
from kvtier.shm import SharedSegment, new_segment_name


_RECV_BYTES = 1 << 16
# Replies: a lookup of the largest request is ~0.5 MiB; a check of a badly damaged disk tier
# lists many problems. The cap keeps a bad server from making us allocate gigabytes.
MAX_REPLY_BYTES = 64 << 20
TRUSTED_SERVER_UIDS_ENV = "KVTIER_TRUSTED_SERVER_UIDS"
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class UntrustedServerError(KvtierError, ConnectionError):
    """The process serving the socket runs as a uid we were not told to trust."""

    code = "untrusted_server"


def _trusted_uids(trusted_server_uids: Sequence[int]) -> set[int]:
    from_env = os.environ.get(TRUSTED_SERVER_UIDS_ENV, "")
    try:
        env_uids = {int(part) for part in from_env.split(",") if part.strip()}
    except ValueError:
        raise KvtierError(f"${TRUSTED_SERVER_UIDS_ENV} must list uids separated by commas, "
                          f"got {from_env!r}") from None
    # root can read any process's memory anyway: trusting it exposes nothing more.
    return {os.getuid(), 0, *trusted_server_uids, *env_uids}


def check_server(sock: socket.socket, path: str, trusted_server_uids: Sequence[int] = ()) -> None:
    """Refuse a server that runs as a uid we do not trust.

    Raises:
        UntrustedServerError: the peer's uid is not ours, root's, nor one we were told to trust.
    """
    pid, uid, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    if uid not in _trusted_uids(trusted_server_uids):
        raise UntrustedServerError(
            f"the process serving {path} (pid {pid}) runs as uid {uid}, not as us (uid "
            f"{os.getuid()}): it may be another user's fake daemon; if a daemon of that uid is "
            f"yours to use, pass trusted_server_uids=[{uid}] or set "
            f"{TRUSTED_SERVER_UIDS_ENV}={uid}")


class DaemonReplyError(KvtierError):
    """The daemon answered with an error; `code` is its error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code


@dataclass(slots=True, frozen=True)
class PoolHandle:
    """A registered pool: its id on this connection and its namespace."""

    pool_id: int
    namespace: Namespace
    page_bytes: int


@dataclass(slots=True, frozen=True)
class JobResult:
    """Completion of a store, recall or prefetch."""

    num_done: int
    failed: dict[bytes, str]  # key -> why it failed
    missing: list[bytes]  # recall: keys the daemon does not hold
    tiers: list[str | None]  # recall: where each key was served from

    @property
    def ok(self) -> bool:
        """True when every key was done."""
        return not self.failed and not self.missing


@dataclass(slots=True, frozen=True)
class RotateResult:
    """Completion of a rotate: the swap-out as a store's result, the swap-in as a recall's."""

    stored: JobResult
    recalled: JobResult

    @property
    def ok(self) -> bool:
        """True when every page was swapped out and every page swapped in."""
        return self.stored.ok and self.recalled.ok


@dataclass(slots=True, frozen=True)
class LookupReply:
    """Longest present prefix and each key's tier ("hbm", "host", "disk" or None)."""

    num_prefix: int
    tiers: list[str | None]


def _job_result(reply: m.JobReply) -> JobResult:
    return JobResult(reply.num_done, dict(zip(reply.failed_keys, reply.failed_reasons)),
                     reply.missing_keys, reply.tiers)


def _rotate_result(reply: m.RotateReply) -> RotateResult:
    return RotateResult(
        JobResult(reply.num_stored, dict(zip(reply.store_failed_keys, reply.store_failed_reasons)),
                  [], []),
        JobResult(reply.num_recalled,
                  dict(zip(reply.recall_failed_keys, reply.recall_failed_reasons)),
                  reply.missing_keys, reply.tiers))


def _namespace_spec(namespace: Namespace) -> m.NamespaceSpec:
    return m.NamespaceSpec(namespace.model_id, namespace.dtype, namespace.layout,
                           namespace.page_tokens, namespace.page_bytes, namespace.tp_rank,
                           namespace.tp_world_size)


def _layout_spec(layout: PoolLayout) -> m.LayoutSpec:
    return m.LayoutSpec(**{f: getattr(layout, f) for f in m.LayoutSpec.__struct_fields__})


def _raise_if_error(reply: m._Reply) -> m._Reply:
    if isinstance(reply, m.Error):
        raise DaemonReplyError(reply.code, reply.message)
    return reply


class Job:
    """A store or recall in flight; `result()` waits for its completion."""

    def __init__(self, client: Client, request_id: int) -> None:
        self._client = client
        self._request_id = request_id

    def result(self) -> JobResult:
        """Wait for completion.

        Raises:
            DaemonReplyError: the request was refused (bad input, unknown pool).
        """
        return _job_result(self._client._wait(self._request_id))


class RotateJob(Job):
    """A rotate in flight; `result()` waits for both of its sides."""

    def result(self) -> RotateResult:  # type: ignore[override]
        """Wait for completion.

        Raises:
            DaemonReplyError: the request was refused (bad input, unknown pool).
        """
        return _rotate_result(self._client._wait(self._request_id))


class Client:
    """A blocking connection to the daemon. Thread-safe; requests may be pipelined.

    Args:
        socket_path: the daemon's socket; default as `kvtier serve` chooses it.
        client_name: shown by `kvtier stats`.
        timeout_s: socket timeout for each read.
        trusted_server_uids: uids besides ours and root's whose daemon we may use.

    Raises:
        ConnectionError: no daemon listens there (the message says how to start one).
        UntrustedServerError: the socket is served by a uid we do not trust.
    """

    def __init__(self, socket_path: str | Path | None = None, client_name: str = "",
                 timeout_s: float = 60.0, trusted_server_uids: Sequence[int] = ()) -> None:
        path = str(socket_path or default_socket_path())
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # A kernel receive timeout, not settimeout(): Python would poll() before every recv.
        seconds = int(timeout_s)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                              struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6)))
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise ConnectionError(f"no kvtier daemon at {path} ({exc.strerror or exc}); "
                                  f"start one with `kvtier serve`") from exc
        try:
            check_server(self._sock, path, trusted_server_uids)
        except BaseException:
            self._sock.close()
            raise
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        # One thread at a time reads the socket and files every reply it reads; the others wait
        # on `_replies_changed`. A thread waiting for a slow store never holds up another
        # thread's recall: the reader hands each reply over as soon as it arrives.
        self._replies_changed = threading.Condition()
        self._reading = False
        self._replies: dict[int, m._Reply] = {}
        self._received = bytearray()
        hello = self._call(m.Hello(self._next_id(), m.PROTOCOL_VERSION, client_name))
        self.client_id = hello.client_id
        self.arena_segment = hello.arena_segment

    def _next_id(self) -> int:
        return next(self._ids)

    def _send(self, request: m._Request) -> int:
        frame = pack_frame(m.encoder.encode(request))
        with self._send_lock:
            self._sock.sendall(frame)
        return request.id

    def _wait(self, request_id: int) -> m._Reply:
        replies = self._replies
        with self._replies_changed:
            while request_id not in replies:
                if self._reading:
                    self._replies_changed.wait()
                    continue
                self._reading = True
                self._replies_changed.release()  # others may take their replies meanwhile
                try:
                    body = self._next_frame()
                finally:
                    self._replies_changed.acquire()
                    self._reading = False
                    self._replies_changed.notify_all()
                reply = m.reply_decoder.decode(body)
                if reply.id == 0:  # the daemon could not read some request of ours
                    raise DaemonReplyError(reply.code, reply.message)
                replies[reply.id] = reply
            return _raise_if_error(replies.pop(request_id))

    def _next_frame(self) -> bytes:
        """The next reply frame's body; one recv usually brings header and body together."""
        received = self._received
        while True:
            if len(received) >= HEADER_BYTES:
                length = int.from_bytes(received[:HEADER_BYTES], "big")
                if length > MAX_REPLY_BYTES:
                    # The stream cannot be resynchronized: this connection is done.
                    self._sock.close()
                    raise FrameTooLarge(f"the daemon sent a reply of {length} bytes, over the "
                                        f"{MAX_REPLY_BYTES}-byte cap")
                end = HEADER_BYTES + length
                if len(received) >= end:
                    body = bytes(received[HEADER_BYTES:end])
                    del received[:end]
                    return body
            try:
                chunk = self._sock.recv(_RECV_BYTES)
            except BlockingIOError:
                raise TimeoutError("the kvtier daemon did not answer in time") from None
            if not chunk:
                raise ConnectionError("the kvtier daemon closed the connection")
            received += chunk

    def _call(self, request: m._Request) -> m._Reply:
        return self._wait(self._send(request))

    def ping(self) -> None:
        """Round trip to the daemon."""
        self._call(m.Ping(self._next_id()))

    def register_pool(self, namespace: Namespace, segment_name: str,
                      layout: PoolLayout) -> PoolHandle:
        """Register the pool in shared-memory segment `segment_name`, laid out as `layout`."""
        reply = self._call(m.RegisterPool(self._next_id(), _namespace_spec(namespace),
                                          segment_name, _layout_spec(layout)))
        return PoolHandle(reply.pool, namespace, reply.page_bytes)

    def open_namespace(self, namespace: Namespace) -> PoolHandle:
        """A handle on `namespace` without pool memory, for `lookup`, `prefetch`, `pin` and
        `delete` from a process that holds no pages (an engine's scheduler)."""
        reply = self._call(m.OpenNamespace(self._next_id(), _namespace_spec(namespace)))
        return PoolHandle(reply.pool, namespace, reply.page_bytes)

    def register_device_pool(self, namespace: Namespace, memory: DeviceMemory,
                             layout: PoolLayout) -> PoolHandle:
        """Register a GPU pool (`kvtier.device_pools.DeviceMemory`) through its CUDA IPC handle.

        The daemon's copies run on its own CUDA streams, in its own process: nothing orders them
        after the engine's kernels. Synchronize the stream that wrote pages before storing them
        (and read recalled pages only once the recall's job is done).
        """
        reply = self._call(m.RegisterPool(
            self._next_id(), _namespace_spec(namespace), "", _layout_spec(layout),
            cuda_ipc_handle=memory.ipc_handle, cuda_device=memory.device,
            size_bytes=memory.size_bytes, cuda_ipc_offset=memory.ipc_offset,
            cuda_pci_bus_id=memory.pci_bus_id))
        return PoolHandle(reply.pool, namespace, reply.page_bytes)

    def unregister_pool(self, pool: PoolHandle) -> None:
        """Stop using a pool; the daemon unmaps it."""
        self._call(m.UnregisterPool(self._next_id(), pool.pool_id))

    def lookup(self, pool: PoolHandle, keys: Sequence[bytes]) -> LookupReply:
        """Longest prefix of `keys` the node holds, and each key's tier."""
        reply = self._call(m.Lookup(self._next_id(), pool.pool_id, list(keys)))
        return LookupReply(reply.num_prefix, reply.tiers)

    def store(self, pool: PoolHandle, keys: Sequence[bytes], page_ids: Sequence[int],
              parent_key: bytes | None = None) -> Job:
        """Start storing pool pages `page_ids[i]` under `keys[i]`; the pages must be written."""
        return Job(self, self._send(m.Store(self._next_id(), pool.pool_id, list(keys),
                                            [int(i) for i in page_ids], parent_key)))

    def recall(self, pool: PoolHandle, keys: Sequence[bytes], page_ids: Sequence[int]) -> Job:
        """Start copying the pages of `keys` into pool pages `page_ids[i]`."""
        return Job(self, self._send(m.Recall(self._next_id(), pool.pool_id, list(keys),
                                             [int(i) for i in page_ids])))

    def rotate(self, pool: PoolHandle, out_keys: Sequence[bytes], out_page_ids: Sequence[int],
               in_keys: Sequence[bytes], in_page_ids: Sequence[int],
               parent_key: bytes | None = None) -> RotateJob:
        """Start swapping pool pages `out_page_ids[i]` out under `out_keys[i]` (paused requests)
        and the pages of `in_keys[j]` into pool pages `in_page_ids[j]` (resumed ones), in one
        call. A swap-in may target a page being swapped out: it waits for that page's swap-out
        only, and is not done if that swap-out failed."""
        return RotateJob(self, self._send(m.Rotate(
            self._next_id(), pool.pool_id, list(out_keys), [int(i) for i in out_page_ids],
            list(in_keys), [int(i) for i in in_page_ids], parent_key)))

    def prefetch(self, pool: PoolHandle, keys: Sequence[bytes]) -> Job:
        """Start bringing disk-resident pages of `keys` up to the host tier."""
        return Job(self, self._send(m.Prefetch(self._next_id(), pool.pool_id, list(keys))))

    def pin(self, pool: PoolHandle, keys: Sequence[bytes], ttl_s: float) -> tuple[int, list[bytes]]:
        """Hold pages against eviction for `ttl_s`; returns (lease id, keys not present)."""
        reply = self._call(m.Pin(self._next_id(), pool.pool_id, list(keys), ttl_s))
        return reply.lease, reply.missing_keys

    def unpin(self, lease: int) -> None:
        """Release a lease."""
        self._call(m.Unpin(self._next_id(), lease))

    def delete(self, pool: PoolHandle, keys: Sequence[bytes]) -> int:
        """Remove pages from every tier; returns how many were present."""
        return self._call(m.Delete(self._next_id(), pool.pool_id, list(keys))).num_deleted

    def stats(self) -> dict:
        """The daemon's live figures (what `kvtier stats --json` prints)."""
        return self._call(m.Stats(self._next_id())).stats

    def check(self, verify_bytes: bool = False) -> list[str]:
        """The daemon's integrity walk; empty when sound."""
        return self._call(m.Check(self._next_id(), verify_bytes)).problems

    def close(self) -> None:
        """Disconnect; the daemon releases this client's leases and pools."""
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient:
    """An asyncio connection to the daemon; many requests may be awaited concurrently."""

    def __init__(self) -> None:
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader_task: asyncio.Task | None = None
        self.client_id = 0

    @classmethod
    async def connect(cls, socket_path: str | Path | None = None, client_name: str = "",
                      trusted_server_uids: Sequence[int] = ()) -> AsyncClient:
        """Connect and say hello; see `Client` for `trusted_server_uids`.

        Raises:
            ConnectionError: no daemon listens there.
            UntrustedServerError: the socket is served by a uid we do not trust.
        """
        client = cls()
        path = str(socket_path or default_socket_path())
        try:
            client._reader, client._writer = await asyncio.open_unix_connection(path)
        except OSError as exc:
            raise ConnectionError(f"no kvtier daemon at {path} ({exc.strerror or exc}); "
                                  f"start one with `kvtier serve`") from exc
        try:
            check_server(client._writer.get_extra_info("socket"), path, trusted_server_uids)
        except BaseException:
            client._writer.close()
            raise
        client._reader_task = asyncio.create_task(client._read_replies())
        hello = await client._call(m.Hello(next(client._ids), m.PROTOCOL_VERSION, client_name))
        client.client_id = hello.client_id
        return client

    async def _read_replies(self) -> None:
        error: BaseException = ConnectionError("the kvtier daemon closed the connection")
        try:
            while (body := await read_frame(self._reader, MAX_REPLY_BYTES)) is not None:
                reply = m.reply_decoder.decode(body)
                future = self._pending.pop(reply.id, None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError,
                FrameTooLarge) as exc:
            error = exc
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def _call(self, request: m._Request) -> m._Reply:
        future = asyncio.get_running_loop().create_future()
        self._pending[request.id] = future
        self._writer.write(pack_frame(m.encoder.encode(request)))
        await self._writer.drain()
        return _raise_if_error(await future)

    async def ping(self) -> None:
        """Round trip to the daemon."""
        await self._call(m.Ping(next(self._ids)))

    async def register_pool(self, namespace: Namespace, segment_name: str,
                            layout: PoolLayout) -> PoolHandle:
        """See `Client.register_pool`."""
        reply = await self._call(m.RegisterPool(next(self._ids), _namespace_spec(namespace),
                                                segment_name, _layout_spec(layout)))
        return PoolHandle(reply.pool, namespace, reply.page_bytes)

    async def open_namespace(self, namespace: Namespace) -> PoolHandle:
        """See `Client.open_namespace`."""
        reply = await self._call(m.OpenNamespace(next(self._ids), _namespace_spec(namespace)))
        return PoolHandle(reply.pool, namespace, reply.page_bytes)

    async def lookup(self, pool: PoolHandle, keys: Sequence[bytes]) -> LookupReply:
        """See `Client.lookup`."""
        reply = await self._call(m.Lookup(next(self._ids), pool.pool_id, list(keys)))
        return LookupReply(reply.num_prefix, reply.tiers)

    async def store(self, pool: PoolHandle, keys: Sequence[bytes], page_ids: Sequence[int],
                    parent_key: bytes | None = None) -> JobResult:
        """See `Client.store`; returns when the job completes."""
        return _job_result(await self._call(m.Store(
            next(self._ids), pool.pool_id, list(keys), [int(i) for i in page_ids], parent_key)))

    async def recall(self, pool: PoolHandle, keys: Sequence[bytes],
                     page_ids: Sequence[int]) -> JobResult:
        """See `Client.recall`; returns when the job completes."""
        return _job_result(await self._call(m.Recall(
            next(self._ids), pool.pool_id, list(keys), [int(i) for i in page_ids])))

    async def rotate(self, pool: PoolHandle, out_keys: Sequence[bytes],
                     out_page_ids: Sequence[int], in_keys: Sequence[bytes],
                     in_page_ids: Sequence[int], parent_key: bytes | None = None) -> RotateResult:
        """See `Client.rotate`; returns when both sides complete."""
        return _rotate_result(await self._call(m.Rotate(
            next(self._ids), pool.pool_id, list(out_keys), [int(i) for i in out_page_ids],
            list(in_keys), [int(i) for i in in_page_ids], parent_key)))

    async def prefetch(self, pool: PoolHandle, keys: Sequence[bytes]) -> JobResult:
        """See `Client.prefetch`."""
        return _job_result(await self._call(m.Prefetch(next(self._ids), pool.pool_id, list(keys))))

    async def pin(self, pool: PoolHandle, keys: Sequence[bytes],
                  ttl_s: float) -> tuple[int, list[bytes]]:
        """See `Client.pin`."""
        reply = await self._call(m.Pin(next(self._ids), pool.pool_id, list(keys), ttl_s))
        return reply.lease, reply.missing_keys

    async def unpin(self, lease: int) -> None:
        """See `Client.unpin`."""
        await self._call(m.Unpin(next(self._ids), lease))

    async def delete(self, pool: PoolHandle, keys: Sequence[bytes]) -> int:
        """See `Client.delete`."""
        return (await self._call(m.Delete(next(self._ids), pool.pool_id, list(keys)))).num_deleted

    async def stats(self) -> dict:
        """See `Client.stats`."""
        return (await self._call(m.Stats(next(self._ids)))).stats

    async def check(self, verify_bytes: bool = False) -> list[str]:
        """See `Client.check`."""
        return (await self._call(m.Check(next(self._ids), verify_bytes))).problems

    async def close(self) -> None:
        """Disconnect; the daemon releases this client's leases and pools."""
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)


class SharedPool:
    """An engine page pool in a new shared-memory segment (the CPU stand-in for device memory).

    `pages` is the `[num_pages, num_layers, 2, segment_bytes]` view the daemon also uses;
    `register(client, namespace)` hands it to the daemon. Close it to unlink the segment.
    """

    def __init__(self, layout: PoolLayout) -> None:
        layout.validate(layout.span_bytes)
        self.layout = layout
        self.segment = SharedSegment.create(new_segment_name("kvtier-pool"), layout.span_bytes)
        self.segment.prefault()
        self.pages = layout.page_view(self.segment.array())

    def page(self, page_id: int) -> np.ndarray:
        """Page `page_id` as a `[num_layers, 2, segment_bytes]` view."""
        return self.pages[page_id]

    def register(self, client: Client, namespace: Namespace) -> PoolHandle:
        """Register this pool with the daemon over `client`."""
        if namespace.page_bytes != self.layout.page_bytes:
            raise ProtocolError(f"namespace pages are {namespace.page_bytes} bytes, this pool's "
                                f"are {self.layout.page_bytes}")
        return client.register_pool(namespace, self.segment.name, self.layout)

    def close(self) -> None:
        """Unmap and unlink the segment (idempotent)."""
        self.pages = np.empty(0, np.uint8)
        self.segment.close()
        self.segment.unlink()

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
