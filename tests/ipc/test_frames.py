"""`frame_end`, the one place the daemon's server and the blocking client cut frames out of what
they have read: where a frame ends, None until all of it is there, the cap checked on the prefix
alone. The frames here are written out by hand (a big-endian 4-byte length, then the body), not
with `pack_frame`, so the reader is checked against the format, not against its own writer."""

from __future__ import annotations

import struct

import pytest

from kvtier.errors import FrameTooLarge
from kvtier.ipc.frames import frame_end


def framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_pipelined_frames_end_where_their_prefixes_say() -> None:
    first, second, third = b"a" * 10, b"", b"c" * 300
    buffer = bytearray(framed(first) + framed(second) + framed(third)[:-1])  # third: 1 byte short
    assert frame_end(buffer, 0, 1024) == 14
    assert frame_end(buffer, 14, 1024) == 18  # an empty body is a whole frame
    assert frame_end(buffer, 18, 1024) is None
    buffer += b"c"
    assert frame_end(buffer, 18, 1024) == 18 + 4 + 300 == len(buffer)
    assert bytes(buffer[22:322]) == third


@pytest.mark.parametrize("num_prefix_bytes", [0, 1, 3])
def test_a_partial_prefix_is_not_a_frame_yet(num_prefix_bytes: int) -> None:
    buffer = b"xyz" + framed(b"hello")[:num_prefix_bytes]
    assert frame_end(buffer, 3, 1024) is None


def test_a_length_over_the_cap_is_refused_from_the_prefix_alone() -> None:
    assert frame_end(framed(b"x" * 1024), 0, 1024) == 1028  # the cap itself is allowed
    with pytest.raises(FrameTooLarge, match="frame of 1025 bytes exceeds the 1024-byte cap"):
        frame_end(b"\x00" * 6 + struct.pack(">I", 1025), 6, 1024)  # no body byte has come
