"""The blocking client: one connection to the daemon, shared by threads.

`Client` speaks every verb of `kvtier.client.verbs`; `store`, `recall`, `rotate` and `prefetch`
return a job at once (`Job`, `RotateJob`), whose `result()` waits for completion, which names
exactly the keys that failed. Requests may be pipelined: one thread at a time reads the socket
and files every reply for whichever thread waits on it. Reply frames are capped in size like
requests (`MAX_REPLY_BYTES`): a bad server cannot make us allocate gigabytes.
Verbs: the daemon's (see `CLIENT_VERBS`), `close`.
"""

from __future__ import annotations

import itertools
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvtier.client import verbs
from kvtier.client.local_lookup import MappedIndex, open_index
from kvtier.client.polling import DEFAULT_POLL_US, ReplyPoller
from kvtier.client.reply_router import ReplyRouter
from kvtier.client.results import JobResult, LookupReply, PoolHandle, RotateResult
from kvtier.client.trust import check_server
from kvtier.errors import DaemonReplyError, FrameTooLarge, IndexRefusedError
from kvtier.ipc import messages as m
from kvtier.ipc.frames import LENGTH_PREFIX_BYTES, frame_end, pack_frame, send_frame_with_fd
from kvtier.ipc.socket_path import default_socket_path
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout

if TYPE_CHECKING:
    from kvtier.client.device_memory import DeviceMemory

R = TypeVar("R")
_RECV_BYTES = 1 << 16
# Replies: a lookup of the largest request is ~0.5 MiB; a check of a badly damaged disk tier
# lists many problems. The cap keeps a bad server from making us allocate gigabytes.
MAX_REPLY_BYTES = 64 << 20


class PendingReply(Generic[R]):
    """A request in flight on a `Client`; `result()` waits for its reply."""

    def __init__(self, client: Client, request_id: int, parse: Callable[[m._Reply], R]) -> None:
        self._client = client
        self._request_id = request_id
        self._parse = parse

    def result(self) -> R:
        """Wait for completion.

        Raises:
            DaemonReplyError: the request was refused (bad input, unknown pool).
        """
        return self._parse(self._client._wait(self._request_id))


class Job(PendingReply[JobResult]):
    """A store, recall or prefetch in flight; `result()` waits for its completion."""


class RotateJob(PendingReply[RotateResult]):
    """A rotate in flight; `result()` waits for both of its sides."""


class Client:
    """A blocking connection to the daemon. Thread-safe; requests may be pipelined.

    Args:
        socket_path: the daemon's socket; default as `kvtier serve` chooses it.
        client_name: shown by `kvtier stats`.
        timeout_s: socket timeout for each read.
        trusted_server_uids: uids besides ours and root's whose daemon we may use.
        poll_us: how long the read of a quick reply (a lookup, pin, ping) polls the socket
            before sleeping on it; 0 never polls (see `kvtier.client.polling`).

    Raises:
        ConnectionError: no daemon listens there (the message says how to start one).
        UntrustedServerError: the socket is served by a uid we do not trust.
    """

    def __init__(self, socket_path: str | Path | None = None, client_name: str = "",
                 timeout_s: float = 60.0, trusted_server_uids: Sequence[int] = (),
                 poll_us: float = DEFAULT_POLL_US) -> None:
        path = str(socket_path or default_socket_path())
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._poller = ReplyPoller(self._sock, poll_us)
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
            self._server_pid, self._server_uid = check_server(self._sock, path,
                                                              trusted_server_uids)
        except BaseException:
            self._sock.close()
            raise
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        # One thread at a time reads the socket and hands each reply to its thread at once.
        self._router: ReplyRouter[m._Reply] = ReplyRouter()
        self._received = bytearray()
        # Namespace handles' lookup indexes (the lookup plane), by pool id.
        self._indexes: dict[int, MappedIndex] = {}
        try:
            hello = self._run(verbs.hello(self._next_id(), client_name))
        except (BrokenPipeError, ConnectionResetError):
            # Refused as it accepted us (a quota): the daemon wrote why, then closed, maybe
            # before our hello went out. Its reason is in our receive buffer.
            self._raise_refusal()
            raise
        except BaseException:
            self._sock.close()
            raise
        self.client_id = hello.client_id
        self.arena_segment = hello.arena_segment

    def _raise_refusal(self) -> None:
        """Raise the error the daemon sent before it closed, if it sent one; else return."""
        try:
            reply = m.reply_decoder.decode(self._next_frame())
        except Exception:  # nothing readable came: the caller raises its own error
            return
        finally:
            self._sock.close()
        if isinstance(reply, m.Error):
            raise DaemonReplyError(reply.code, reply.message)

    def _next_id(self) -> int:
        return next(self._ids)

    def _send(self, request: m._Request) -> int:
        frame = pack_frame(m.encoder.encode(request))
        with self._send_lock:
            self._sock.sendall(frame)
        return request.id

    def _wait(self, request_id: int, quick: bool = False) -> m._Reply:
        """The reply to `request_id`; a `quick` one (expected at once) is polled for."""
        read_reply = self._read_quick_reply if quick else self._read_reply
        return verbs.raise_if_error(self._router.wait(request_id, read_reply))

    def _read_quick_reply(self) -> tuple[int, m._Reply]:
        # Polled only while no other thread waits: with requests pipelined the replies stream
        # in anyway, and a poll would hold the GIL the other threads need to send theirs.
        return self._read_reply(poll=not self._router.others_waiting)

    def _read_reply(self, poll: bool = False) -> tuple[int, m._Reply]:
        reply = m.reply_decoder.decode(self._next_frame(poll))
        if reply.id == 0 and isinstance(reply, m.Error):
            # the daemon could not read some request of ours
            raise DaemonReplyError(reply.code, reply.message)
        return reply.id, reply

    def _next_frame(self, poll: bool = False) -> bytes:
        """The next reply frame's body; one recv usually brings header and body together
        (polled for first, with `poll`).

        Raises:
            FrameTooLarge: the length prefix is over `MAX_REPLY_BYTES` (nothing is allocated
                for it, and the connection is closed: the stream cannot be resynchronized).
        """
        received = self._received
        if not received:  # the common case: one read brings one whole reply, nothing else
            chunk = self._recv(poll)
            length = int.from_bytes(chunk[:LENGTH_PREFIX_BYTES], "big")
            if len(chunk) == LENGTH_PREFIX_BYTES + length and length <= MAX_REPLY_BYTES:
                return chunk[LENGTH_PREFIX_BYTES:]
            received += chunk
        while True:
            try:
                end = frame_end(received, 0, MAX_REPLY_BYTES)
            except FrameTooLarge as exc:
                self._sock.close()
                raise FrameTooLarge(f"the daemon sent a reply over the client's cap: "
                                    f"{exc}") from None
            if end is not None:
                body = bytes(received[LENGTH_PREFIX_BYTES:end])
                del received[:end]
                return body
            received += self._recv()

    def _recv(self, poll: bool = False) -> bytes:
        """The next bytes the daemon sent (blocks up to the client's timeout)."""
        try:
            chunk = self._poller.recv(_RECV_BYTES, poll)
        except BlockingIOError:
            raise TimeoutError("the kvtier daemon did not answer in time") from None
        if not chunk:
            raise ConnectionError("the kvtier daemon closed the connection")
        return chunk

    def _call(self, request: m._Request) -> m._Reply:
        return self._wait(self._send(request), quick=True)

    def _run(self, call: verbs.Call[R]) -> R:
        return call.parse(self._call(call.request))

    def ping(self) -> None:
        """Round trip to the daemon."""
        self._run(verbs.ping(self._next_id()))

    def register_pool(self, namespace: Namespace, segment_name: str,
                      layout: PoolLayout) -> PoolHandle:
        """Register the pool in shared-memory segment `segment_name`, laid out as `layout`."""
        return self._run(verbs.register_pool(self._next_id(), namespace, segment_name, layout))

    def register_sealed_pool(self, namespace: Namespace, fd: int, layout: PoolLayout,
                             name: str = "") -> PoolHandle:
        """Register the pool in sealed memfd `fd` (`kvtier.sealed_memory.create_sealed`; named
        `name` in the daemon's messages), laid out as `layout`. The daemon maps it: copies run
        at memcpy speed. `fd` stays ours (the daemon receives a copy of it).

        Raises:
            DaemonReplyError: the pool is refused (not sealed, too small, a bad layout).
        """
        for _ in range(2):  # a resend when the daemon's plain read dropped the descriptor
            call = verbs.register_sealed_pool(self._next_id(), namespace, fd, layout, name)
            frame = pack_frame(m.encoder.encode(call.request))
            with self._send_lock:
                send_frame_with_fd(self._sock, frame, call.fd)
            try:
                return call.parse(self._wait(call.request.id))
            except DaemonReplyError as exc:
                if exc.code != m.RESEND_DESCRIPTOR:
                    raise
        raise DaemonReplyError(m.RESEND_DESCRIPTOR, "the daemon did not receive the pool's "
                                                    "descriptor")

    def open_namespace(self, namespace: Namespace) -> PoolHandle:
        """A handle on `namespace` without pool memory, for `lookup`, `prefetch`, `pin` and
        `delete` from a process that holds no pages (an engine's scheduler). Its lookups are
        answered from the daemon's key index, mapped here, where the daemon publishes one."""
        handle = self._run(verbs.open_namespace(self._next_id(), namespace))
        self._map_index(handle)
        return handle

    def _map_index(self, handle: PoolHandle) -> MappedIndex | None:
        """Map (again) the lookup index of `handle`'s namespace; None where there is none to
        trust (lookups then go over the socket)."""
        old = self._indexes.pop(handle.pool_id, None)
        if old is not None:
            old.close()
        try:
            reply = self._call(m.LookupIndex(self._next_id(), handle.pool_id))
            if not isinstance(reply, m.LookupIndexReply):
                return None
            index = open_index(self._server_pid, self._server_uid, reply.fd, reply.generation,
                               reply.size_bytes, handle.namespace.fingerprint)
        except (DaemonReplyError, IndexRefusedError):
            return None
        self._indexes[handle.pool_id] = index
        return index

    def register_device_pool(self, namespace: Namespace, memory: DeviceMemory,
                             layout: PoolLayout) -> PoolHandle:
        """Register a GPU pool (`kvtier.client.DeviceMemory`) through its CUDA IPC handle.

        The daemon's copies run on its own CUDA streams, in its own process: nothing orders them
        after the engine's kernels. Synchronize the stream that wrote pages before storing them
        (and read recalled pages only once the recall's job is done).
        """
        return self._run(verbs.register_device_pool(self._next_id(), namespace, memory, layout))

    def unregister_pool(self, pool: PoolHandle) -> None:
        """Stop using a pool; the daemon unmaps it."""
        index = self._indexes.pop(pool.pool_id, None)
        if index is not None:
            index.close()
        self._run(verbs.unregister_pool(self._next_id(), pool))

    def lookup(self, pool: PoolHandle, keys: Sequence[bytes]) -> LookupReply:
        """Longest prefix of `keys` the node holds, and each key's tier.

        On a handle from `open_namespace` the prefix comes from the mapped key index, with no
        system call (its `tiers`, read, ask the daemon); it may count a page evicted a moment
        ago, which its recall then reports missing, never another page's bytes.
        """
        index = self._indexes.get(pool.pool_id)
        if index is not None:
            num_prefix = index.longest_prefix(keys)
            if num_prefix is None and index.retired:  # rebuilt bigger, or the daemon stopped
                index = self._map_index(pool)
                num_prefix = index.longest_prefix(keys) if index is not None else None
            if num_prefix is not None:
                return LookupReply(num_prefix, ask_tiers=lambda: self._run(
                    verbs.lookup(self._next_id(), pool, keys)).tiers)
        return self._run(verbs.lookup(self._next_id(), pool, keys))

    @property
    def local_lookup_pool_ids(self) -> frozenset[int]:
        """The handles (pool ids) whose `lookup` is answered from a mapped key index."""
        return frozenset(self._indexes)

    def store(self, pool: PoolHandle, keys: Sequence[bytes], page_ids: Sequence[int],
              parent_key: bytes | None = None) -> Job:
        """Start storing pool pages `page_ids[i]` under `keys[i]`; the pages must be written."""
        call = verbs.store(self._next_id(), pool, keys, page_ids, parent_key)
        return Job(self, self._send(call.request), call.parse)

    def recall(self, pool: PoolHandle, keys: Sequence[bytes], page_ids: Sequence[int]) -> Job:
        """Start copying the pages of `keys` into pool pages `page_ids[i]`."""
        call = verbs.recall(self._next_id(), pool, keys, page_ids)
        return Job(self, self._send(call.request), call.parse)

    def rotate(self, pool: PoolHandle, out_keys: Sequence[bytes], out_page_ids: Sequence[int],
               in_keys: Sequence[bytes], in_page_ids: Sequence[int],
               parent_key: bytes | None = None) -> RotateJob:
        """Start swapping pool pages `out_page_ids[i]` out under `out_keys[i]` (paused requests)
        and the pages of `in_keys[j]` into pool pages `in_page_ids[j]` (resumed ones), in one
        call. A swap-in may target a page being swapped out: it waits for that page's swap-out
        only, and is not done if that swap-out failed."""
        call = verbs.rotate(self._next_id(), pool, out_keys, out_page_ids, in_keys, in_page_ids,
                            parent_key)
        return RotateJob(self, self._send(call.request), call.parse)

    def prefetch(self, pool: PoolHandle, keys: Sequence[bytes]) -> Job:
        """Start bringing disk-resident pages of `keys` up to the host tier."""
        call = verbs.prefetch(self._next_id(), pool, keys)
        return Job(self, self._send(call.request), call.parse)

    def pin(self, pool: PoolHandle, keys: Sequence[bytes], ttl_s: float) -> tuple[int, list[bytes]]:
        """Hold pages against eviction for `ttl_s`; returns (lease id, keys not present)."""
        return self._run(verbs.pin(self._next_id(), pool, keys, ttl_s))

    def unpin(self, lease: int) -> None:
        """Release a lease."""
        self._run(verbs.unpin(self._next_id(), lease))

    def delete(self, pool: PoolHandle, keys: Sequence[bytes]) -> int:
        """Remove pages from every tier; returns how many were present."""
        return self._run(verbs.delete(self._next_id(), pool, keys))

    def stats(self) -> dict[str, Any]:
        """The daemon's live figures (what `kvtier stats --json` prints)."""
        return self._run(verbs.stats(self._next_id()))

    def check(self, verify_bytes: bool = False) -> list[str]:
        """The daemon's integrity walk; empty when sound."""
        return self._run(verbs.check(self._next_id(), verify_bytes))

    def close(self) -> None:
        """Disconnect; the daemon releases this client's leases and pools."""
        for index in self._indexes.values():
            index.close()
        self._indexes.clear()
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
