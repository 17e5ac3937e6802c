"""Length-prefixed frames: a 4-byte big-endian length, then that many bytes of msgpack.

The length is checked against a hard cap before any buffer is allocated, so a crafted prefix
cannot make the reader allocate more than the cap: both sides' readers (the daemon's server, the
blocking and the asyncio client) check it with `check_frame_length`. A frame may carry a file
descriptor (a pool's sealed memfd) as SCM_RIGHTS ancillary data on its first bytes
(`send_frame_with_fd`). Verbs: `pack_frame`, `read_frame`, `recv_frame`, `check_frame_length`,
`send_frame_with_fd`.
"""

from __future__ import annotations

import array
import asyncio
import socket

from kvtier.errors import FrameTooLarge

HEADER_BYTES = 4
DEFAULT_MAX_FRAME_BYTES = 8 << 20


def check_frame_length(header: bytes | bytearray, max_frame_bytes: int) -> int:
    """The body length a frame's header announces, checked before anything is allocated for it.

    Raises:
        FrameTooLarge: the length exceeds `max_frame_bytes`.
    """
    length = int.from_bytes(header[:HEADER_BYTES], "big")
    if length > max_frame_bytes:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the {max_frame_bytes}-byte cap")
    return length


def send_frame_with_fd(sock: socket.socket, frame: bytes, fd: int) -> None:
    """Send a whole packed `frame` on a blocking socket, `fd` riding with its first bytes.

    The caller holds whatever keeps other writers off the socket until it returns.
    """
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   array.array("i", [fd]).tobytes())])
    if sent < len(frame):
        sock.sendall(frame[sent:])


def pack_frame(body: bytes) -> bytes:
    """`body` with its length prefix."""
    return len(body).to_bytes(HEADER_BYTES, "big") + body


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> bytes | None:
    """The next frame's body, or None at a clean end of stream.

    Raises:
        FrameTooLarge: the length prefix exceeds `max_frame_bytes`.
        asyncio.IncompleteReadError: the peer closed mid-frame.
    """
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    return await reader.readexactly(check_frame_length(header, max_frame_bytes))


def recv_frame(sock: socket.socket, max_frame_bytes: int) -> bytes:
    """Blocking read of one frame body from `sock`.

    Raises:
        ConnectionError: the peer closed the connection.
        FrameTooLarge: the length prefix exceeds `max_frame_bytes`.
    """
    length = check_frame_length(_recv_exactly(sock, HEADER_BYTES), max_frame_bytes)
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    received = 0
    while received < num_bytes:
        got = sock.recv_into(view[received:])
        if got == 0:
            raise ConnectionError("the kvtier daemon closed the connection")
        received += got
    return bytes(buffer)
