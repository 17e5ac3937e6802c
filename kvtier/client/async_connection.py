"""The asyncio client: one connection to the daemon, many requests awaited concurrently.

`AsyncClient` serves the same verbs as `Client`, built by the same `kvtier.client.verbs`; its
`store`, `recall`, `rotate` and `prefetch` return when the job completes. One reader task files
every reply for whichever coroutine awaits it; reply frames are capped at `MAX_REPLY_BYTES`.
Verbs: `AsyncClient.connect`, the daemon's (see `CLIENT_VERBS`), `close`.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from kvtier.client import verbs
from kvtier.client.connection import MAX_REPLY_BYTES
from kvtier.client.results import JobResult, LookupReply, PoolHandle, RotateResult
from kvtier.client.trust import check_server
from kvtier.errors import DaemonReplyError
from kvtier.ipc import messages as m
from kvtier.ipc.frames import LENGTH_PREFIX_BYTES, FrameTooLarge, frame_end, pack_frame, read_frame
from kvtier.ipc.socket_path import default_socket_path
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout

if TYPE_CHECKING:
    from kvtier.client.device_memory import DeviceMemory

R = TypeVar("R")


class AsyncClient:
    """An asyncio connection to the daemon; make one with `connect`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[m._Reply]] = {}
        self._reader_task: asyncio.Task[None] | None = None
        # An error the daemon sent about no request of ours (id 0): why it hangs up, when it does
        self._refusal: DaemonReplyError | None = None
        self.client_id = 0

    @classmethod
    async def connect(cls, socket_path: str | Path | None = None, client_name: str = "",
                      trusted_server_uids: Sequence[int] = ()) -> AsyncClient:
        """Connect and say hello; see `Client` for `trusted_server_uids`.

        Raises:
            ConnectionError: no daemon listens there.
            UntrustedServerError: the socket is served by a uid we do not trust.
            FrameTooLarge: the server's reply is over `MAX_REPLY_BYTES`.
        """
        path = str(socket_path or default_socket_path())
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, path)
        except OSError as exc:
            sock.close()
            raise ConnectionError(f"no kvtier daemon at {path} ({exc.strerror or exc}); "
                                  f"start one with `kvtier serve`") from exc
        ids = itertools.count(1)
        hello = verbs.hello(next(ids), client_name)
        try:
            check_server(sock, path, trusted_server_uids)
            # The hello goes out on the bare socket: a daemon that refuses us (a quota) writes
            # why and hangs up as it accepts, and a stream's transport drops what it had not
            # read once its write fails. Here the reason is still there to read.
            try:
                await loop.sock_sendall(sock, pack_frame(m.encoder.encode(hello.request)))
            except (BrokenPipeError, ConnectionResetError):
                refusal = _refusal_in(sock)
                if refusal is not None:
                    raise refusal from None
                raise
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            raise
        client = cls(reader, writer)
        client._ids = ids
        future: asyncio.Future[m._Reply] = loop.create_future()
        client._pending[hello.request.id] = future
        client._reader_task = asyncio.create_task(client._read_replies())
        try:
            reply = hello.parse(verbs.raise_if_error(await future))
        except BaseException:
            await client.close()
            raise
        client.client_id = reply.client_id
        return client

    async def _read_replies(self) -> None:
        error: BaseException = ConnectionError("the kvtier daemon closed the connection")
        try:
            while (body := await read_frame(self._reader, MAX_REPLY_BYTES)) is not None:
                reply = m.reply_decoder.decode(body)
                if reply.id == 0 and isinstance(reply, m.Error):
                    # A refusal (a quota as it accepted us) or a request it could not read:
                    # what every call still waiting hears if the daemon hangs up now.
                    self._refusal = DaemonReplyError(reply.code, reply.message)
                    continue
                future = self._pending.pop(reply.id, None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError,
                FrameTooLarge) as exc:
            error = exc
        if self._refusal is not None:
            error = self._refusal
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def _call(self, request: m._Request) -> m._Reply:
        future: asyncio.Future[m._Reply] = asyncio.get_running_loop().create_future()
        self._pending[request.id] = future
        self._writer.write(pack_frame(m.encoder.encode(request)))
        await self._writer.drain()
        return verbs.raise_if_error(await future)

    async def _run(self, call: verbs.Call[R]) -> R:
        return call.parse(await self._call(call.request))

    async def ping(self) -> None:
        """Round trip to the daemon."""
        await self._run(verbs.ping(next(self._ids)))

    async def register_pool(self, namespace: Namespace, segment_name: str,
                            layout: PoolLayout) -> PoolHandle:
        """See `Client.register_pool`."""
        return await self._run(verbs.register_pool(next(self._ids), namespace, segment_name,
                                                   layout))

    async def register_sealed_pool(self, namespace: Namespace, fd: int, layout: PoolLayout,
                                   name: str = "") -> PoolHandle:
        """See `Client.register_sealed_pool`."""
        for _ in range(2):  # a resend when the daemon's plain read dropped the descriptor
            call = verbs.register_sealed_pool(next(self._ids), namespace, fd, layout, name)
            future: asyncio.Future[m._Reply] = asyncio.get_running_loop().create_future()
            self._pending[call.request.id] = future
            await self._send_with_fd(pack_frame(m.encoder.encode(call.request)), call.fd)
            reply = await future
            if not (isinstance(reply, m.Error) and reply.code == m.RESEND_DESCRIPTOR):
                return call.parse(verbs.raise_if_error(reply))
        raise DaemonReplyError(m.RESEND_DESCRIPTOR, "the daemon did not receive the pool's "
                                                    "descriptor")

    async def _send_with_fd(self, frame: bytes, fd: int) -> None:
        """Write `frame` with `fd` riding on its first byte. The transport cannot carry a
        descriptor: wait until it holds nothing (a limit of 0 makes drain wait for an empty
        buffer), then send on the socket directly, with no await between the two, so no other
        frame can interleave; what the socket does not take goes behind, through the transport.
        """
        transport = self._writer.transport
        loop = asyncio.get_running_loop()
        sock = socket.socket(fileno=os.dup(self._writer.get_extra_info("socket").fileno()))
        try:
            while True:
                transport.set_write_buffer_limits(0)
                try:
                    await self._writer.drain()
                finally:
                    transport.set_write_buffer_limits()
                if transport.get_write_buffer_size():
                    continue  # another coroutine wrote meanwhile
                try:
                    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                   array.array("i", [fd]).tobytes())])
                except BlockingIOError:  # the socket is full: wait until it drains
                    writable = loop.create_future()
                    loop.add_writer(sock.fileno(), writable.set_result, None)
                    try:
                        await writable
                    finally:
                        loop.remove_writer(sock.fileno())
                    continue
                if sent < len(frame):
                    self._writer.write(frame[sent:])
                return
        finally:
            sock.close()  # the dup only

    async def register_device_pool(self, namespace: Namespace, memory: DeviceMemory,
                                   layout: PoolLayout) -> PoolHandle:
        """See `Client.register_device_pool` (the same ordering rule for the engine's writes)."""
        return await self._run(verbs.register_device_pool(next(self._ids), namespace, memory,
                                                          layout))

    async def open_namespace(self, namespace: Namespace) -> PoolHandle:
        """See `Client.open_namespace`."""
        return await self._run(verbs.open_namespace(next(self._ids), namespace))

    async def unregister_pool(self, pool: PoolHandle) -> None:
        """See `Client.unregister_pool`."""
        await self._run(verbs.unregister_pool(next(self._ids), pool))

    async def lookup(self, pool: PoolHandle, keys: Sequence[bytes]) -> LookupReply:
        """See `Client.lookup`."""
        return await self._run(verbs.lookup(next(self._ids), pool, keys))

    async def store(self, pool: PoolHandle, keys: Sequence[bytes], page_ids: Sequence[int],
                    parent_key: bytes | None = None) -> JobResult:
        """See `Client.store`; returns when the job completes."""
        return await self._run(verbs.store(next(self._ids), pool, keys, page_ids, parent_key))

    async def recall(self, pool: PoolHandle, keys: Sequence[bytes],
                     page_ids: Sequence[int]) -> JobResult:
        """See `Client.recall`; returns when the job completes."""
        return await self._run(verbs.recall(next(self._ids), pool, keys, page_ids))

    async def rotate(self, pool: PoolHandle, out_keys: Sequence[bytes],
                     out_page_ids: Sequence[int], in_keys: Sequence[bytes],
                     in_page_ids: Sequence[int], parent_key: bytes | None = None) -> RotateResult:
        """See `Client.rotate`; returns when both sides complete."""
        return await self._run(verbs.rotate(next(self._ids), pool, out_keys, out_page_ids,
                                            in_keys, in_page_ids, parent_key))

    async def prefetch(self, pool: PoolHandle, keys: Sequence[bytes]) -> JobResult:
        """See `Client.prefetch`; returns when the job completes."""
        return await self._run(verbs.prefetch(next(self._ids), pool, keys))

    async def pin(self, pool: PoolHandle, keys: Sequence[bytes],
                  ttl_s: float) -> tuple[int, list[bytes]]:
        """See `Client.pin`."""
        return await self._run(verbs.pin(next(self._ids), pool, keys, ttl_s))

    async def unpin(self, lease: int) -> None:
        """See `Client.unpin`."""
        await self._run(verbs.unpin(next(self._ids), lease))

    async def delete(self, pool: PoolHandle, keys: Sequence[bytes]) -> int:
        """See `Client.delete`."""
        return await self._run(verbs.delete(next(self._ids), pool, keys))

    async def stats(self) -> dict[str, Any]:
        """See `Client.stats`."""
        return await self._run(verbs.stats(next(self._ids)))

    async def check(self, verify_bytes: bool = False) -> list[str]:
        """See `Client.check`."""
        return await self._run(verbs.check(next(self._ids), verify_bytes))

    async def close(self) -> None:
        """Disconnect; the daemon releases this client's leases and pools."""
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:  # the daemon hung up first: closed all the same
            pass
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)


def _refusal_in(sock: socket.socket) -> DaemonReplyError | None:
    """The error the daemon wrote before it hung up, from what `sock` has received; None when
    it wrote none (the caller raises its own error)."""
    received = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except OSError:  # nothing more buffered (or the connection was reset): what came, came
        pass
    try:
        end = frame_end(received, 0, MAX_REPLY_BYTES)
        reply = m.reply_decoder.decode(bytes(received[LENGTH_PREFIX_BYTES:end])) if end else None
    except (FrameTooLarge, msgspec.DecodeError):
        return None
    return DaemonReplyError(reply.code, reply.message) if isinstance(reply, m.Error) else None
