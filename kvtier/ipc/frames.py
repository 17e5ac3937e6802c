"""Length-prefixed frames: a 4-byte big-endian length, then that many bytes of msgpack.

The length is checked against a hard cap before any buffer is allocated, so a crafted prefix
cannot make a reader allocate more than the cap. The buffered readers, the daemon's server and
the blocking client, which read what the socket has into a buffer and cut whole frames out of
it, both find a frame's end with `frame_end`; the stream readers (the asyncio client's
`read_frame`, `recv_frame`) read the prefix alone and check it with `check_frame_length`. A
frame may carry a file descriptor (a pool's sealed memfd) as SCM_RIGHTS ancillary data on its
first bytes (`send_frame_with_fd`). Verbs: `pack_frame`, `frame_end`, `read_frame`,
`recv_frame`, `check_frame_length`, `send_frame_with_fd`.
"""

from __future__ import annotations

import array
import asyncio
import socket

from kvtier.errors import FrameTooLarge

LENGTH_PREFIX_BYTES = 4
DEFAULT_MAX_FRAME_BYTES = 8 << 20


def check_frame_length(prefix: bytes | bytearray, max_frame_bytes: int) -> int:
    """The body length a frame's length prefix announces, checked before anything is allocated
    for it.

    Raises:
        FrameTooLarge: the length exceeds `max_frame_bytes`.
    """
    length = int.from_bytes(prefix[:LENGTH_PREFIX_BYTES], "big")
    if length > max_frame_bytes:
        raise _too_large(length, max_frame_bytes)
    return length


def frame_end(buffer: bytes | bytearray, offset: int, max_frame_bytes: int) -> int | None:
    """Where the frame starting at `offset` of `buffer` ends, or None while it is not all there.

    Its body is `buffer[offset + LENGTH_PREFIX_BYTES : end]`.

    Raises:
        FrameTooLarge: its length prefix exceeds `max_frame_bytes` (known as soon as the prefix
            is there: the reader need not wait for bytes it would refuse).
    """
    body_start = offset + LENGTH_PREFIX_BYTES
    if len(buffer) < body_start:
        return None
    length = int.from_bytes(buffer[offset:body_start], "big")
    if length > max_frame_bytes:
        raise _too_large(length, max_frame_bytes)
    end = body_start + length
    return end if len(buffer) >= end else None


def _too_large(length: int, max_frame_bytes: int) -> FrameTooLarge:
    return FrameTooLarge(f"frame of {length} bytes exceeds the {max_frame_bytes}-byte cap")


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
    return len(body).to_bytes(LENGTH_PREFIX_BYTES, "big") + body


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> bytes | None:
    """The next frame's body, or None at a clean end of stream.

    Raises:
        FrameTooLarge: the length prefix exceeds `max_frame_bytes`.
        asyncio.IncompleteReadError: the peer closed mid-frame.
    """
    try:
        header = await reader.readexactly(LENGTH_PREFIX_BYTES)
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
    length = check_frame_length(_recv_exactly(sock, LENGTH_PREFIX_BYTES), max_frame_bytes)
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
