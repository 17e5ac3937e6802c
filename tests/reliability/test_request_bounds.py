"""Crafted sizes cannot make the daemon allocate beyond a fixed bound.

A request naming one key more than `MAX_KEYS_PER_REQUEST` is refused; a length prefix of 2 GiB
or a msgpack array header claiming 4 billion keys gets an error reply without the daemon's
memory moving; the connection (or, after an oversized frame, a new one) keeps working.
"""

from __future__ import annotations

import socket
from pathlib import Path

import msgspec
import psutil
import pytest

from kvtier.client import DaemonReplyError, SegmentPool
from kvtier.ipc import messages as m
from kvtier.ipc.frames import DEFAULT_MAX_FRAME_BYTES, pack_frame, recv_frame
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout
from kvtier.testing.daemon_process import DaemonProcess

LAYOUT = PoolLayout.page_first(8, 2, 16, 2, 64, "float16")
NAMESPACE = Namespace("bounds", "float16", "page-first", 16, LAYOUT.page_bytes)
KEY = bytes(range(16))
# Far below what any of the crafted sizes would cost if it were honoured (2 GiB, 64 GiB).
RSS_SLACK_BYTES = 32 << 20
PEAK_SLACK_BYTES = 256 << 20


class RawSocket:
    """Frames the client library never sends, on a connection with a pool registered."""

    def __init__(self, socket_path: Path, pool: SegmentPool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(socket_path))
        assert isinstance(self.call({"verb": "hello", "id": 1, "version": 1}), m.HelloReply)
        self.pool_id = self.call({
            "verb": "register_pool", "id": 2, "segment": pool.segment.name,
            "namespace": {f: getattr(NAMESPACE, f) for f in m.NamespaceSpec.__struct_fields__},
            "layout": {f: getattr(LAYOUT, f) for f in m.LayoutSpec.__struct_fields__}}).pool

    def call(self, fields: dict) -> m._Reply:
        self.send_body(msgspec.msgpack.encode(fields))
        return self.reply()

    def send_body(self, body: bytes) -> None:
        self.sock.sendall(pack_frame(body))

    def reply(self) -> m._Reply:
        return m.reply_decoder.decode(recv_frame(self.sock, DEFAULT_MAX_FRAME_BYTES))

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def peak_bytes(pid: int) -> int:
    """VmPeak: the most address space the process ever had mapped."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmPeak in /proc/<pid>/status")


@pytest.fixture
def raw(reliability_daemon: DaemonProcess):
    with SegmentPool(LAYOUT) as pool:
        connection = RawSocket(reliability_daemon.socket_path, pool)
        yield connection
        connection.sock.close()


@pytest.mark.parametrize("verb", ["lookup", "store", "recall", "delete", "pin"])
def test_one_key_over_the_per_request_limit_is_refused(reliability_daemon: DaemonProcess,
                                                        verb: str) -> None:
    keys = [KEY] * (m.MAX_KEYS_PER_REQUEST + 1)
    with reliability_daemon.client("bounds") as client, SegmentPool(LAYOUT) as pool:
        handle = pool.register(client, NAMESPACE)
        calls = {"lookup": lambda: client.lookup(handle, keys),
                 "store": lambda: client.store(handle, keys, [0] * len(keys)).result(),
                 "recall": lambda: client.recall(handle, keys, [0] * len(keys)).result(),
                 "delete": lambda: client.delete(handle, keys),
                 "pin": lambda: client.pin(handle, keys, 1.0)}
        with pytest.raises(DaemonReplyError, match=f"limit is {m.MAX_KEYS_PER_REQUEST}") as error:
            calls[verb]()
        assert error.value.code == "bad_request"
        assert client.lookup(handle, keys[:m.MAX_KEYS_PER_REQUEST]).num_prefix == 0


def test_length_prefix_of_two_gib_is_refused_without_allocating(
        reliability_daemon: DaemonProcess, raw: RawSocket) -> None:
    process = psutil.Process(reliability_daemon.pid)
    rss_before, peak_before = process.memory_info().rss, peak_bytes(reliability_daemon.pid)

    raw.sock.sendall((2**31).to_bytes(4, "big") + b"\0" * 4096)

    reply = raw.reply()
    assert isinstance(reply, m.Error) and reply.code == "frame_too_large"
    assert raw.closed_by_peer()
    assert process.memory_info().rss - rss_before < RSS_SLACK_BYTES
    assert peak_bytes(reliability_daemon.pid) - peak_before < PEAK_SLACK_BYTES
    with reliability_daemon.client("after") as client:
        client.ping()


@pytest.mark.parametrize("field", ["keys", "page_ids"])
def test_array_header_claiming_four_billion_items_is_refused_without_allocating(
        reliability_daemon: DaemonProcess, raw: RawSocket, field: str) -> None:
    request = {"verb": "store", "id": 7, "pool": raw.pool_id, "keys": [KEY], "page_ids": [0]}
    request[field] = request.pop(field)  # last, so its array header ends the body
    body = msgspec.msgpack.encode(request)
    last_item = msgspec.msgpack.encode(request[field][0])
    assert body.endswith(b"\x91" + last_item)
    crafted = body[: -len(last_item) - 1] + b"\xdd\xff\xff\xff\xff" + last_item
    process = psutil.Process(reliability_daemon.pid)
    rss_before, peak_before = process.memory_info().rss, peak_bytes(reliability_daemon.pid)

    raw.send_body(crafted)

    reply = raw.reply()
    assert isinstance(reply, m.Error) and reply.code == "bad_request"
    assert process.memory_info().rss - rss_before < RSS_SLACK_BYTES
    assert peak_bytes(reliability_daemon.pid) - peak_before < PEAK_SLACK_BYTES
    assert isinstance(raw.call({"verb": "ping", "id": 8}), m.Pong)


def test_store_sent_before_an_oversized_frame_is_still_answered(raw: RawSocket) -> None:
    store = msgspec.msgpack.encode({"verb": "store", "id": 5, "pool": raw.pool_id,
                                    "keys": [KEY], "page_ids": [0]})
    raw.sock.sendall(pack_frame(store) + (2**31).to_bytes(4, "big"))

    replies = []
    while len(replies) < 2:
        try:
            replies.append(raw.reply())
        except ConnectionError:
            break
    assert sorted(type(r).__name__ for r in replies) == ["Error", "JobReply"], replies
