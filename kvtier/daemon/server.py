"""The asyncio control server: accepts clients on a Unix socket and answers their frames.

An `asyncio.Protocol` per connection, not streams: a lookup is answered inside `data_received`,
with no task and no thread hop (streams plus a task per request cost 40-50 µs a round trip here,
against 10-18 µs for a bare socket echo). Each connection: check the peer's uid (SO_PEERCRED),
then cut frames out of the byte stream. A register_pool frame carries its pool's sealed memfd
(SCM_RIGHTS; see kvtier/sealed_memory.py), which a transport's plain reads drop: on the first
such frame the connection is read with recvmsg instead and the client told to resend
(`RESEND_DESCRIPTOR`), and once the descriptor came, by the transport again, so no other request
pays for it. What a request does is up to the `RequestHandler` (kvtier.daemon.handler; the daemon's
is the service, which this module does not import): inline verbs are answered at once; copies and
disk I/O go to the handler's thread pool, at most `max_inflight_per_client` per connection (reading
pauses beyond that), and `stats` to a thread of its own. A frame over the size cap gets an error
reply and the connection closes; an undecodable frame gets an error reply with id 0. When a
connection ends, the handler closes its session (the service releases its leases and pools) once its
requests in flight have finished.

No client may starve the others or exhaust the daemon (`kvtier.daemon.limits`): each connection
gets at most `frames_per_turn` frames, and `bytes_per_turn` bytes of them, answered per turn of
the loop (the rest wait, reading paused, for its next turn); a frame over `inline_frame_bytes`
(thousands of keys) is decoded on the handler's one bulk thread, never on the loop, and answered
there (lookup, pin) or on the copy threads (store, recall), its reply encoded there too; connections
are capped in number, per process (`max_clients_per_peer`, so one process cannot take every slot)
and by the file descriptors left; unfinished frames of all connections together are capped in bytes
(the client crossing the cap is cut off), and a frame that stalls mid-way past `frame_timeout_s`
closes its connection.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import msgspec

from kvtier.daemon.handler import Deferred, RequestHandler
from kvtier.daemon.limits import DEFAULT_LIMITS, FdBudget, Limits, raise_fd_limit
from kvtier.errors import FrameTooLarge, QuotaError
from kvtier.ipc import messages as m
from kvtier.ipc.frames import LENGTH_PREFIX_BYTES, frame_end, pack_frame

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_KEPT_BUFFER_BYTES = 1 << 20  # an empty receive buffer larger than this is let go
_READ_BYTES = 256 * 1024  # what asyncio's socket transports read at a time
# Descriptors one read may bring (a register_pool frame carries one); the kernel closes any
# beyond this, so a client cannot make us hold more than it may register.
_MAX_FDS_PER_READ = 4
_ANCILLARY_BYTES = socket.CMSG_SPACE(_MAX_FDS_PER_READ * array.array("i").itemsize)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def _carries_descriptor(request: m._Request) -> bool:
    """A sealed pool's register_pool: its memfd came (or was dropped) with its bytes."""
    return type(request) is m.RegisterPool and request.descriptor

class _Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: ControlServer) -> None:
        self._server = server
        self._service = server.service
        self._limits = server.limits
        self._transport: asyncio.Transport | None = None
        self._session: Any = None  # the handler's, for this connection; None until accepted
        self._buffer = bytearray()
        self._inflight: set[asyncio.Future[Any]] = set()
        self._reading_paused = False
        self._turn_pending = False  # whole frames wait in the buffer for this client's next turn
        self._stall_timer: asyncio.TimerHandle | None = None
        self._holds_fd = False
        self._peer: tuple[int, int] | None = None  # (uid, pid), counted while connected
        self._closed = False  # no more requests are read
        self._transport_lost = False
        # The connection is read here, not by the transport: with recvmsg, so a pool's sealed
        # memfd can ride with its register_pool frame (SCM_RIGHTS). A dup of the socket, since
        # the loop refuses a reader on a descriptor its transport owns.
        self._reader_sock: socket.socket | None = None
        self._reader_added = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A Unix stream server's transports are full Transports; the Protocol API types them as
        # the base class it shares with datagram and subprocess transports.
        self._transport = cast(asyncio.Transport, transport)
        server = self._server
        pid, uid = peer_credentials(transport.get_extra_info("socket"))
        if uid not in server.allowed_uids:
            log.warning("refused a connection from uid %d (pid %d)", uid, pid)
            self._refuse(m.Error(0, "permission_denied", f"uid {uid} may not use this daemon"))
            return
        if len(server.connections) >= self._limits.max_clients:
            self._refuse(m.Error(0, QuotaError.code, f"the daemon serves its limit of "
                                 f"{self._limits.max_clients} clients (daemon.max_clients); "
                                 f"try again when one leaves"))
            return
        peer = (uid, pid)
        if server.connections_by_peer[peer] >= self._limits.max_clients_per_peer:
            self._refuse(m.Error(0, QuotaError.code, f"process {pid} holds "
                                 f"{server.connections_by_peer[peer]} connections, its share "
                                 f"(daemon.max_clients_per_peer); share a connection between "
                                 f"threads, or close one first"))
            return
        if not server.fd_budget.try_take(1):
            self._refuse(m.Error(0, QuotaError.code, f"the daemon is out of file descriptors "
                                 f"({server.fd_budget.used} held); try again later"))
            return
        self._holds_fd = True
        self._peer = peer
        server.connections_by_peer[peer] += 1
        server.connections.add(self)
        self._session = self._service.open_session(uid, pid)

    def _start_descriptor_reader(self) -> bool:
        """Read the connection with recvmsg (through a dup of its socket: the loop refuses a
        reader on a descriptor its transport owns) until a register_pool's descriptor came;
        False when no descriptor is left for the dup."""
        if self._reader_sock is not None:
            return True
        assert self._transport is not None
        if not self._server.fd_budget.try_take(1):
            return False
        try:
            reader_fd = os.dup(self._transport.get_extra_info("socket").fileno())
        except OSError:  # EMFILE: descriptors held outside the budget
            self._server.fd_budget.give_back(1)
            return False
        self._reader_sock = socket.socket(fileno=reader_fd)
        self._reader_sock.setblocking(False)
        self._apply_reading()
        return True

    def _stop_descriptor_reader(self) -> None:
        """Back to the transport's reads (the fast path)."""
        if self._reader_sock is None:
            return
        self._set_reader(False)
        self._reader_sock.close()
        self._reader_sock = None
        self._server.fd_budget.give_back(1)
        self._apply_reading()

    def _apply_reading(self) -> None:
        """Read through the transport, or through the recvmsg reader while one is open, only
        while this client may be served."""
        transport = self._transport
        if transport is None or transport.is_closing():
            self._set_reader(False)
            return
        own = self._reader_sock is not None
        if self._reading_paused or own:
            transport.pause_reading()
        else:
            transport.resume_reading()
        self._set_reader(own and not self._reading_paused)

    def _set_reader(self, on: bool) -> None:
        if self._reader_sock is None or on == self._reader_added:
            return
        loop = asyncio.get_running_loop()
        if on:
            loop.add_reader(self._reader_sock.fileno(), self._read_ready)
        else:
            loop.remove_reader(self._reader_sock.fileno())
        self._reader_added = on

    def _read_ready(self) -> None:
        assert self._reader_sock is not None
        try:
            data, ancillary, _, _ = self._reader_sock.recvmsg(_READ_BYTES, _ANCILLARY_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._set_reader(False)
            if self._transport is not None:
                self._transport.abort()
            return
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                for fd in fds:
                    self._adopt_descriptor(fd)
        if not data:  # the peer closed its end
            self._set_reader(False)
            self._close_transport()
            return
        self._received(data)

    def _adopt_descriptor(self, fd: int) -> None:
        """Hand a received descriptor to the handler (the next register_pool takes it), within
        the daemon's descriptor budget; one it cannot hold is closed at once."""
        if self._session is None or self._closed or not self._server.fd_budget.try_take(1):
            os.close(fd)
            return
        self._service.adopt_descriptor(self._session, fd)

    def _refuse(self, error: m.Error) -> None:
        self._reply(error)
        self._closed = True
        self._close_transport()

    def data_received(self, data: bytes) -> None:
        self._received(data)

    def _received(self, data: bytes) -> None:
        if self._session is None or self._closed:
            return
        if not self._buffer and self._answer_lone_frame(data):
            return
        self._buffer += data
        server = self._server
        server.buffered_bytes += len(data)
        self._serve_frames()
        if server.buffered_bytes > self._limits.max_buffered_bytes and self._buffer:
            # Unanswered frames of all clients together are bounded: the client whose bytes
            # cross the limit is cut off (whole frames answered at once never count).
            self._reply(m.Error(0, QuotaError.code, f"the daemon holds {server.buffered_bytes} "
                                f"bytes of unfinished frames, more than its limit "
                                f"(daemon.max_buffered_bytes); send smaller frames or try again"))
            self._hang_up()

    def _answer_lone_frame(self, data: bytes) -> bool:
        """Answer `data` straight from the read when it is exactly one small whole frame and
        nothing waits before it (a lookup or ping waited on: the common read); False, with
        nothing done, for any other read, which goes through the buffer. Skipping the buffer
        saved a fifth of the daemon's share of a lookup's round trip."""
        if self._turn_pending or len(self._inflight) >= self._server.max_inflight_per_client:
            return False
        length = int.from_bytes(data[:LENGTH_PREFIX_BYTES], "big")
        if (len(data) != LENGTH_PREFIX_BYTES + length or length > self._limits.inline_frame_bytes
                or length > self._server.max_frame_bytes):
            return False
        self._dispatch(memoryview(data)[LENGTH_PREFIX_BYTES:])
        self._update_reading()
        return True

    def _serve_frames(self) -> None:
        """Answer whole frames from the buffer, at most `frames_per_turn` of them: a client that
        pipelines thousands of requests in one write must not keep the loop from the others."""
        self._turn_pending = False
        if self._closed:
            return
        buffer, max_frame_bytes = self._buffer, self._server.max_frame_bytes
        frames_left = self._limits.frames_per_turn
        # The loop's work grows with the keys in a frame, not the number of frames: a turn
        # also ends after `bytes_per_turn` bytes of frames (about 18 per key) answered here.
        bytes_left = self._limits.bytes_per_turn
        inline_frame_bytes = self._limits.inline_frame_bytes
        offset = 0
        while len(buffer) - offset >= LENGTH_PREFIX_BYTES:
            if bytes_left <= 0:
                frames_left = 0  # this turn is spent: the rest waits for the next
            if not frames_left or len(self._inflight) >= self._server.max_inflight_per_client:
                break
            try:
                end = frame_end(buffer, offset, max_frame_bytes)
            except FrameTooLarge as exc:
                # Checked before any allocation: the bytes are never buffered.
                self._reply(m.Error(0, "frame_too_large", str(exc)))
                self._hang_up()
                return
            if end is None:
                break
            body_start = offset + LENGTH_PREFIX_BYTES
            length = end - body_start
            body = bytes(buffer[body_start:end])
            if length > inline_frame_bytes:
                self._dispatch_off_loop(body)  # decoding alone would hold the loop for ms
            else:
                self._dispatch(body)
                bytes_left -= length
            offset = end
            frames_left -= 1
            if self._closed:
                return
        if offset:
            del buffer[:offset]
            self._server.buffered_bytes -= offset
            if not buffer and sys.getsizeof(buffer) > _KEPT_BUFFER_BYTES:
                self._buffer = bytearray()  # a bytearray keeps its largest size: give it back
        if not frames_left and self._has_whole_frame():
            self._turn_pending = True
            asyncio.get_running_loop().call_soon(self._serve_frames)  # behind the others
        self._update_reading()
        self._watch_for_stall(frame_done=offset > 0)

    def _has_whole_frame(self) -> bool:
        """Whether the buffer starts with a frame to act on: whole, or announced over the cap
        (its error reply must not wait for bytes that will never come)."""
        try:
            return frame_end(self._buffer, 0, self._server.max_frame_bytes) is not None
        except FrameTooLarge:
            return True

    def _update_reading(self) -> None:
        """Read from the socket only while this client may be served: nothing queues unbounded."""
        pause = (self._closed or self._turn_pending
                 or len(self._inflight) >= self._server.max_inflight_per_client)
        if pause != self._reading_paused and self._transport is not None:
            self._reading_paused = pause
            self._apply_reading()

    def _watch_for_stall(self, frame_done: bool) -> None:
        """Time a frame from its first byte while we read: a peer that stops mid-frame must not
        hold its buffer (and a share of the daemon's budget) for ever."""
        partial = bool(self._buffer) and not self._reading_paused
        if self._stall_timer is not None and (frame_done or not partial):
            self._stall_timer.cancel()
            self._stall_timer = None
        if partial and self._stall_timer is None:
            self._stall_timer = asyncio.get_running_loop().call_later(
                self._limits.frame_timeout_s, self._on_stall)

    def _on_stall(self) -> None:
        self._stall_timer = None
        if self._closed:
            return
        self._reply(m.Error(0, "frame_timeout", f"a frame stalled: {len(self._buffer)} bytes of "
                            f"it arrived, the rest not within {self._limits.frame_timeout_s:g} s "
                            f"(daemon.frame_timeout)"))
        self._hang_up()

    def _dispatch(self, body: bytes | memoryview) -> None:
        try:
            request = m.request_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._reply(m.Error(0, "bad_request", f"undecodable request: {exc}"))
            return
        self._dispatch_request(request)

    def _dispatch_request(self, request: m._Request) -> None:
        if _carries_descriptor(request):
            if self._reader_sock is None:
                # The transport read the frame, and the kernel dropped the descriptor it
                # carried: read with recvmsg until one comes, and ask the client to resend.
                if self._start_descriptor_reader():
                    self._reply(m.Error(request.id, m.RESEND_DESCRIPTOR, "send the pool's "
                                        "descriptor again with a new register_pool frame"))
                else:
                    self._reply(m.Error(request.id, QuotaError.code, "the daemon is out of "
                                        "file descriptors; try again later"))
                return
            # Its descriptor, if it sent one, arrived with its bytes: the fast path again.
            self._stop_descriptor_reader()
        if self._service.is_inline(request):
            reply = self._service.handle(self._session, request)
            if not isinstance(reply, Deferred):
                self._reply(reply)
                return  # the fast path: no loop lookup (it asks the kernel for our pid)
            # Local part answered on the loop; the rest (a remote round trip) off it.
            future = asyncio.get_running_loop().run_in_executor(self._service.remote_executor,
                                                                reply.finish)
        elif type(request) is m.Stats:
            # ~ms of numpy per snapshot: off the loop, one thread, shared by the requests waiting.
            future = asyncio.get_running_loop().run_in_executor(
                self._service.stats_executor, self._service.stats_reply, request,
                time.monotonic())
            self._service.stats_in_flight.add(future)
            future.add_done_callback(self._service.stats_in_flight.discard)
        else:
            future = asyncio.get_running_loop().run_in_executor(self._service.executor,
                                                                self._answer, request)
        self._track(future)

    def _track(self, future: asyncio.Future[Any]) -> None:
        """Count a request answered off the loop until its reply (a `_Reply`, or a frame
        encoded there) is sent."""
        self._inflight.add(future)
        self._server.inflight.add(future)
        future.add_done_callback(self._on_done)

    def _dispatch_off_loop(self, body: bytes) -> None:
        """A large frame (a lookup, pin or store of thousands of keys): decoded on the bulk
        thread, so the loop spends no time on its keys. A verb the loop would answer is answered
        there too, its reply encoded there; the others come back to be routed (`_on_done`)."""
        self._server.num_large_frames += 1
        self._track(asyncio.get_running_loop().run_in_executor(
            self._service.bulk_executor, self._answer_large_frame, body))

    def _answer_large_frame(self, body: bytes) -> bytes | m._Request:
        """On the bulk thread: the encoded reply frame, or the decoded request when it copies
        pages or reads stats (it runs where those run)."""
        try:
            request = m.request_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return pack_frame(m.encoder.encode(m.Error(0, "bad_request",
                                                       f"undecodable request: {exc}")))
        if (type(request) is m.Stats or not self._service.is_inline(request)
                or _carries_descriptor(request)):  # its descriptor is the loop's to look for
            return request
        return pack_frame(m.encoder.encode(self._answer(request)))

    def _answer_encoded(self, request: m._Request) -> bytes:
        """`_answer`, its reply encoded on the same thread (a large request's large reply)."""
        return pack_frame(m.encoder.encode(self._answer(request)))

    def _route_decoded(self, request: m._Request) -> None:
        """A large frame's request decoded on the bulk thread that copies pages or reads stats."""
        loop = asyncio.get_running_loop()
        if _carries_descriptor(request):
            self._dispatch_request(request)  # a long model id makes a large frame, no bulk
        elif type(request) is m.Stats:
            self._track(loop.run_in_executor(self._service.stats_executor,
                                             self._service.stats_reply, request, time.monotonic()))
        else:
            self._track(loop.run_in_executor(self._service.executor, self._answer_encoded,
                                             request))

    def _answer(self, request: m._Request) -> m._Reply:
        """The handler's reply, on one of its threads (a `Deferred` one finished there too)."""
        reply = self._service.handle(self._session, request)
        return reply.finish() if isinstance(reply, Deferred) else reply

    def _drop_buffer(self) -> None:
        self._server.buffered_bytes -= len(self._buffer)
        self._buffer = bytearray()  # clear() keeps the allocation
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _hang_up(self) -> None:
        """Read nothing more; close once the requests already in flight have been answered."""
        self._closed = True
        self._drop_buffer()
        self._update_reading()
        if not self._inflight:
            self._close_transport()

    def _close_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _on_done(self, future: asyncio.Future[Any]) -> None:
        self._inflight.discard(future)
        self._server.inflight.discard(future)
        if not future.cancelled():
            reply = future.result()
            if isinstance(reply, bytes):  # encoded off the loop
                self._write(reply)
            elif isinstance(reply, m._Request):
                if not self._closed:  # a client cut off or gone gets nothing more done
                    self._route_decoded(reply)
            else:
                self._reply(reply)
        if self._closed:
            if not self._inflight:
                self._close_transport()  # a hang-up waiting for its last answer
                if self._transport_lost:
                    self._release()
            return
        if not self._turn_pending and self._has_whole_frame():
            self._turn_pending = True  # frames held back by the in-flight cap
            asyncio.get_running_loop().call_soon(self._serve_frames)
        self._update_reading()

    def _reply(self, reply: m._Reply) -> None:
        self._write(pack_frame(m.encoder.encode(reply)))

    def _write(self, frame: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._transport_lost = True
        self._drop_buffer()
        if self._reader_sock is not None:
            self._set_reader(False)
            self._reader_sock.close()
            self._reader_sock = None
            self._server.fd_budget.give_back(1)
        self._server.connections.discard(self)
        if self._peer is not None:
            by_peer = self._server.connections_by_peer
            by_peer[self._peer] -= 1
            if not by_peer[self._peer]:
                del by_peer[self._peer]
            self._peer = None
        if self._holds_fd:
            self._server.fd_budget.give_back(1)
            self._holds_fd = False
        if not self._inflight:
            self._release()  # else the last request in flight releases (its copy uses the pool)

    def _release(self) -> None:
        if self._session is not None:
            self._service.close_session(self._session)
            if self._server.watch_released is not None:  # both should die by refcount now
                self._server.watch_released(self._session)
                self._server.watch_released(self)
            self._session = None

    def abort(self) -> None:
        """Close the connection now (shutdown)."""
        if self._transport is not None:
            self._transport.close()


class ControlServer:
    """Serves `service` (any `RequestHandler`) on a Unix socket until `close`."""

    def __init__(self, service: RequestHandler[Any], max_frame_bytes: int,
                 max_inflight_per_client: int, allowed_uids: tuple[int, ...] = (),
                 limits: Limits = DEFAULT_LIMITS, fd_budget: FdBudget | None = None,
                 watch_released: Callable[[object], None] | None = None) -> None:
        self.service = service
        # Told of each closed connection and its session (`HeapKeeper.watch`).
        self.watch_released = watch_released
        self.max_frame_bytes = max_frame_bytes
        self.max_inflight_per_client = max_inflight_per_client
        self.allowed_uids = {os.getuid(), *allowed_uids}
        self.limits = limits
        self.fd_budget = fd_budget or FdBudget(raise_fd_limit())
        self.buffered_bytes = 0  # of unanswered frames, all connections together
        self.num_large_frames = 0  # answered off the loop since start (housekeeping trims after)
        self.connections: set[_Connection] = set()
        self.connections_by_peer: Counter[tuple[int, int]] = Counter()  # by (uid, pid)
        self.inflight: set[asyncio.Future[Any]] = service.jobs_in_flight  # the service counts them
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: str, mode: int = 0o600, gid: int = -1) -> None:
        """Listen on `path` (which must not exist) with `mode`, in group `gid` (-1: as made)."""
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # the socket is never reachable by others, not even briefly
        try:
            self._server = await loop.create_unix_server(lambda: _Connection(self), path=path)
        finally:
            os.umask(old_umask)
        os.chown(path, -1, gid)  # the group first: mode 0660 must not open it to our own group
        os.chmod(path, mode)

    @property
    def num_requests_in_flight(self) -> int:
        """Requests being answered in the thread pool now."""
        return len(self.inflight)

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop accepting, let requests in flight finish (up to the timeout), drop connections."""
        if self._server is not None:
            self._server.close()
        if self.inflight:
            _, pending = await asyncio.wait(set(self.inflight), timeout=drain_timeout_s)
            if pending:
                log.warning("%d requests still running at shutdown", len(pending))
        for connection in list(self.connections):
            connection.abort()
        await asyncio.sleep(0)  # let connection_lost callbacks run before the store closes
        if self._server is not None:
            await self._server.wait_closed()
