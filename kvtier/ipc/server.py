"""The asyncio control server: accepts clients on a Unix socket and answers their frames.

Each connection: check the peer's uid (SO_PEERCRED), then read frames; each decoded request is
answered in its own task (a slow store never holds up a lookup), up to a per-client cap of
requests in flight. A frame over the size cap closes the connection; an undecodable frame gets
an error reply with id 0. When a connection ends, its session's leases and pools are released.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct

import msgspec

from kvtier.ipc import messages as m
from kvtier.ipc.frames import FrameTooLarge, pack_frame, read_frame
from kvtier.service import Service, Session

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


class ControlServer:
    """Serves `service` on a Unix socket until `close`."""

    def __init__(self, service: Service, max_frame_bytes: int, max_inflight_per_client: int,
                 allowed_uids: tuple[int, ...] = ()) -> None:
        self._service = service
        self._max_frame_bytes = max_frame_bytes
        self._max_inflight = max_inflight_per_client
        self._allowed_uids = {os.getuid(), *allowed_uids}
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()
        self._requests: set[asyncio.Task] = set()

    async def start(self, path: str, mode: int = 0o600) -> None:
        """Listen on `path` (which must not exist), readable and writable only by `mode`."""
        old_umask = os.umask(0o177)  # the socket is never reachable by others, not even briefly
        try:
            self._server = await asyncio.start_unix_server(self._on_connect, path=path)
        finally:
            os.umask(old_umask)
        os.chmod(path, mode)

    async def _on_connect(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            pid, uid = peer_credentials(writer.get_extra_info("socket"))
            if uid not in self._allowed_uids:
                log.warning("refused a connection from uid %d (pid %d)", uid, pid)
                await self._send(writer, m.Error(0, "permission_denied",
                                                 f"uid {uid} may not use this kvtier daemon"))
                return
            session = self._service.open_session(uid, pid)
            try:
                await self._serve(session, reader, writer)
            finally:
                self._service.close_session(session)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; its session is already released
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve(self, session: Session, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        inflight = asyncio.Semaphore(self._max_inflight)
        mine: set[asyncio.Task] = set()
        write_lock = asyncio.Lock()
        try:
            while True:
                try:
                    body = await read_frame(reader, self._max_frame_bytes)
                except FrameTooLarge as exc:
                    await self._send(writer, m.Error(0, exc.code, str(exc)))
                    return
                if body is None:
                    return
                try:
                    request = m.request_decoder.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    await self._send(writer, m.Error(0, "bad_request", f"undecodable request: {exc}"))
                    continue
                await inflight.acquire()
                task = asyncio.create_task(self._answer(session, request, writer, write_lock,
                                                        inflight))
                mine.add(task)
                self._requests.add(task)
                task.add_done_callback(mine.discard)
                task.add_done_callback(self._requests.discard)
        finally:
            # Copies in flight still use this client's pool: let them finish before release.
            if mine:
                await asyncio.gather(*mine, return_exceptions=True)

    async def _answer(self, session: Session, request: m._Request, writer: asyncio.StreamWriter,
                      write_lock: asyncio.Lock, inflight: asyncio.Semaphore) -> None:
        try:
            reply = await self._service.handle(session, request)
            async with write_lock:
                await self._send(writer, reply)
        except (ConnectionError, RuntimeError):
            pass  # the client is gone; nothing to answer
        finally:
            inflight.release()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, reply: m._Reply) -> None:
        writer.write(pack_frame(m.encoder.encode(reply)))
        await writer.drain()

    @property
    def num_requests_in_flight(self) -> int:
        """Requests being answered now."""
        return len(self._requests)

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop accepting, let requests in flight finish (up to the timeout), drop connections."""
        if self._server is not None:
            self._server.close()
        if self._requests:
            done, pending = await asyncio.wait(set(self._requests), timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("cancelled %d requests still running at shutdown", len(pending))
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
