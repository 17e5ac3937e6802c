"""Both clients cap a reply frame before reading it, as the daemon caps requests.

A fake server of our own uid (the peer, not the thing under test) answers the hello with a length
prefix of 1 GiB and then nothing: a client that trusted the prefix would wait for the rest or
allocate for it. Each client must refuse the frame at once, with `FrameTooLarge`, having
allocated nothing near the announced size.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client import MAX_REPLY_BYTES, AsyncClient, Client
from kvtier.ipc.frames import LENGTH_PREFIX_BYTES, FrameTooLarge, check_frame_length

ANNOUNCED_BYTES = 1 << 30


@pytest.fixture
def oversized_server(socket_dir: Path) -> Iterator[Path]:
    path = socket_dir / "fake.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    hold = threading.Event()

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)  # the hello
            connection.sendall(ANNOUNCED_BYTES.to_bytes(LENGTH_PREFIX_BYTES, "big")
                               + b"\x00" * 1024)
            hold.wait(60)  # and then nothing: the rest of the "frame" never comes

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield path
    finally:
        hold.set()
        server.join(10)
        listener.close()


def test_the_blocking_client_refuses_an_oversized_reply_without_allocating(
        oversized_server: Path) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge, match=f"frame of {ANNOUNCED_BYTES} bytes"):
            Client(oversized_server, timeout_s=20.0)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 16 << 20


def test_the_async_client_refuses_an_oversized_reply_without_allocating(
        oversized_server: Path) -> None:
    async def connect() -> None:
        await asyncio.wait_for(AsyncClient.connect(oversized_server), timeout=20.0)

    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge, match=f"frame of {ANNOUNCED_BYTES} bytes"):
            asyncio.run(connect())
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 16 << 20


def test_the_cap_is_one_check_for_every_reader() -> None:
    header = MAX_REPLY_BYTES.to_bytes(LENGTH_PREFIX_BYTES, "big")
    assert check_frame_length(header, MAX_REPLY_BYTES) == MAX_REPLY_BYTES
    with pytest.raises(FrameTooLarge, match="exceeds the 1024-byte cap"):
        check_frame_length((1025).to_bytes(LENGTH_PREFIX_BYTES, "big"), 1024)
