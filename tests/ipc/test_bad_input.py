"""Bad input of every kind against a live daemon: each gets an error reply with a code and a
sentence (or, for a broken frame, a closed connection), and nobody else notices.

Requests are plain dicts encoded with msgpack and framed by hand, so they can be anything the
client library would never send. After each one, the same connection still answers a ping
(unless the daemon had to close it) and a bystander client, connected all along with pages
stored, still gets its bytes back and an integrity check with no problems.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from kvtier.client import Client, PoolHandle, SegmentPool
from kvtier.ipc import messages as m
from kvtier.ipc.frames import DEFAULT_MAX_FRAME_BYTES, pack_frame
from kvtier.testing import daemon as harness

REQUEST_ID = 41
GOOD_KEY = b"k" * 16
NUM_RAW_PAGES = 8


@dataclass
class Bystander:
    """A well-behaved client with pages stored, connected through every bad request."""

    client: Client
    pool: SegmentPool
    handle: PoolHandle
    keys: list[bytes]
    pages: np.ndarray

    def assert_unaffected(self) -> None:
        self.client.ping()
        assert self.client.lookup(self.handle, self.keys).num_prefix == len(self.keys)
        result = self.client.recall(self.handle, self.keys, range(4, 8)).result()
        assert result.ok
        np.testing.assert_array_equal(harness.snapshot(self.pool, range(4, 8)), self.pages)
        assert self.client.check() == []


@dataclass
class RawPool:
    """A raw connection with a pool registered on it, and what a request needs to name things."""

    conn: harness.RawConnection
    pool_id: int
    segment: str
    namespace: dict
    layout: dict
    other_pool_id: int  # the bystander's: valid, but not on this connection


@pytest.fixture(scope="module")
def bystander(daemon) -> Iterator[Bystander]:
    layout = harness.make_layout("page-first", 8)
    with daemon.client("bystander") as client, SegmentPool(layout) as pool:
        handle = pool.register(client, harness.namespace_for(layout, "bystander"))
        harness.fill_random(pool, np.random.default_rng(20), range(8))
        keys = harness.random_keys(np.random.default_rng(21), 4)
        assert client.store(handle, keys, range(4)).result().ok
        yield Bystander(client, pool, handle, keys, harness.snapshot(pool, range(4)))
        assert client.check(verify_bytes=True) == []


@pytest.fixture
def raw(daemon, bystander: Bystander, make_pool) -> Iterator[RawPool]:
    layout = harness.make_layout("page-first", NUM_RAW_PAGES)
    pool = make_pool(layout, named=True)
    namespace = harness.namespace_spec(harness.namespace_for(layout, "raw"))
    layout_fields = harness.layout_spec(layout)
    conn = harness.RawConnection(daemon.socket_path)
    try:
        reply = conn.call(verb="register_pool", id=1, namespace=namespace,
                          segment=pool.segment.name, layout=layout_fields)
        assert isinstance(reply, m.PoolReply), reply
        yield RawPool(conn, reply.pool, pool.segment.name, namespace, layout_fields,
                      bystander.handle.pool_id)
    finally:
        conn.close()
    bystander.assert_unaffected()


def register(ctx: RawPool, namespace: dict | None = None, layout: dict | None = None,
             segment: str | None = None) -> dict:
    return {"verb": "register_pool", "id": REQUEST_ID, "namespace": namespace or ctx.namespace,
            "layout": layout or ctx.layout, "segment": ctx.segment if segment is None else segment}


def request(verb: str, **fields: object) -> dict:
    return {"verb": verb, "id": REQUEST_ID, **fields}


@dataclass(frozen=True)
class Case:
    body: Callable[[RawPool], bytes | dict]  # a dict is msgpack-encoded
    reply_id: int
    code: str
    says: str  # a fragment of the sentence the reply must carry


UNDECODABLE = {
    "malformed msgpack": Case(lambda c: b"\xc1", 0, "bad_request", "undecodable"),
    "truncated msgpack": Case(lambda c: b"\x82\xa4verb", 0, "bad_request", "undecodable"),
    "empty body": Case(lambda c: b"", 0, "bad_request", "undecodable"),
    "not a map": Case(lambda c: [1, 2, 3], 0, "bad_request", "undecodable"),
    "unknown verb": Case(lambda c: request("explode"), 0, "bad_request", "explode"),
    "no verb": Case(lambda c: {"id": REQUEST_ID}, 0, "bad_request", "verb"),
    "pool of the wrong type": Case(lambda c: request("lookup", pool="one", keys=[]), 0,
                                   "bad_request", "$.pool"),
    "keys of the wrong type": Case(lambda c: request("lookup", pool=c.pool_id, keys=["abc"]), 0,
                                   "bad_request", "$.keys"),
    "page ids of the wrong type": Case(lambda c: request(
        "store", pool=c.pool_id, keys=[GOOD_KEY], page_ids=["0"]), 0, "bad_request", "page_ids"),
    "ttl of the wrong type": Case(lambda c: request(
        "pin", pool=c.pool_id, keys=[GOOD_KEY], ttl_s="long"), 0, "bad_request", "ttl_s"),
    "missing page ids": Case(lambda c: request("store", pool=c.pool_id, keys=[GOOD_KEY]), 0,
                             "bad_request", "page_ids"),
    "missing id": Case(lambda c: {"verb": "ping"}, 0, "bad_request", "id"),
    "unknown field": Case(lambda c: request("ping", bogus=1), 0, "bad_request", "bogus"),
    "namespace missing a field": Case(lambda c: register(c, namespace={
        k: v for k, v in c.namespace.items() if k != "page_bytes"}), 0, "bad_request",
        "page_bytes"),
}

REFUSED = {
    "page id past the pool": Case(lambda c: request(
        "store", pool=c.pool_id, keys=[GOOD_KEY], page_ids=[NUM_RAW_PAGES]), REQUEST_ID,
        "bad_request", f"page id {NUM_RAW_PAGES} is out of range"),
    "negative page id": Case(lambda c: request(
        "recall", pool=c.pool_id, keys=[GOOD_KEY], page_ids=[-1]), REQUEST_ID, "bad_request",
        "page id -1 is out of range"),
    "key too short": Case(lambda c: request("lookup", pool=c.pool_id, keys=[GOOD_KEY, b"short"]),
                          REQUEST_ID, "bad_request", "key #1 must be 16 bytes, got 5 bytes"),
    "stored key too long": Case(lambda c: request(
        "store", pool=c.pool_id, keys=[b"x" * 17], page_ids=[0]), REQUEST_ID, "bad_request",
        "must be 16 bytes"),
    "pinned key too long": Case(lambda c: request(
        "pin", pool=c.pool_id, keys=[b"x" * 17], ttl_s=1.0), REQUEST_ID, "bad_request",
        "must be 16 bytes"),
    "parent key too short": Case(lambda c: request(
        "store", pool=c.pool_id, keys=[GOOD_KEY], page_ids=[0], parent_key=b"p"), REQUEST_ID,
        "bad_request", "must be 16 bytes"),
    "too many keys": Case(lambda c: request(
        "lookup", pool=c.pool_id, keys=[GOOD_KEY] * (m.MAX_KEYS_PER_REQUEST + 1)), REQUEST_ID,
        "bad_request", f"the limit is {m.MAX_KEYS_PER_REQUEST}"),
    "unknown pool": Case(lambda c: request("lookup", pool=10**6, keys=[GOOD_KEY]), REQUEST_ID,
                         "bad_request", "unknown pool 1000000"),
    "pool of another connection": Case(lambda c: request(
        "recall", pool=c.other_pool_id, keys=[GOOD_KEY], page_ids=[0]), REQUEST_ID,
        "bad_request", "register it on this connection first"),
    "unregister an unknown pool": Case(lambda c: request("unregister_pool", pool=10**6),
                                       REQUEST_ID, "bad_request", "unknown pool"),
    "more keys than page ids": Case(lambda c: request(
        "store", pool=c.pool_id, keys=[GOOD_KEY, b"l" * 16], page_ids=[0]), REQUEST_ID,
        "bad_request", "2 keys but 1 page ids"),
    "more page ids than keys": Case(lambda c: request(
        "recall", pool=c.pool_id, keys=[GOOD_KEY], page_ids=[0, 1]), REQUEST_ID, "bad_request",
        "1 keys but 2 page ids"),
    "lease without a ttl": Case(lambda c: request(
        "pin", pool=c.pool_id, keys=[GOOD_KEY], ttl_s=0.0), REQUEST_ID, "bad_request",
        "positive ttl_s"),
    "unpin of an unknown lease": Case(lambda c: request("unpin", lease=10**9), REQUEST_ID,
                                      "bad_request", "no live lease 1000000000"),
    "wrong protocol version": Case(lambda c: request("hello", version=99), REQUEST_ID,
                                   "bad_request", "protocol version 99 is not supported"),
    "segment that does not exist": Case(lambda c: register(c, segment="kvtier-pool-0-missing"),
                                        REQUEST_ID, "storage",
                                        "cannot open shared-memory segment kvtier-pool-0-missing"),
    "segment name with a slash": Case(lambda c: register(c, segment="../etc/passwd"),
                                      REQUEST_ID, "bad_request", "bad segment name"),
    "layout that exceeds the segment": Case(lambda c: register(
        c, layout={**c.layout, "num_pages": NUM_RAW_PAGES + 1}), REQUEST_ID, "bad_request",
        "reaches byte"),
    "layout offset past the segment": Case(lambda c: register(
        c, layout={**c.layout, "offset_bytes": 1}), REQUEST_ID, "bad_request", "reaches byte"),
    "negative stride": Case(lambda c: register(
        c, layout={**c.layout, "layer_stride_bytes": -1}), REQUEST_ID, "bad_request",
        "layer_stride_bytes must not be negative"),
    "overlapping K and V": Case(lambda c: register(
        c, layout={**c.layout, "kv_stride_bytes": 1}), REQUEST_ID, "bad_request", "overlap"),
    "page bytes that disagree with the namespace": Case(lambda c: register(
        c, namespace={**c.namespace, "page_bytes": 2 * c.namespace["page_bytes"]}), REQUEST_ID,
        "bad_request", "namespace says"),
    "dtype that disagrees with the namespace": Case(lambda c: register(
        c, layout={**c.layout, "dtype": "bfloat16"}), REQUEST_ID, "bad_request",
        "must match its namespace"),
    "unknown dtype": Case(lambda c: register(
        c, namespace={**c.namespace, "dtype": "float3"}, layout={**c.layout, "dtype": "float3"}),
        REQUEST_ID, "bad_request", "unknown dtype 'float3'"),
    "empty model id": Case(lambda c: register(c, namespace={**c.namespace, "model_id": ""}),
                           REQUEST_ID, "bad_request", "model_id must not be empty"),
    "rank outside the world": Case(lambda c: register(
        c, namespace={**c.namespace, "tp_rank": 2, "tp_world_size": 2}), REQUEST_ID,
        "bad_request", "tp_world_size"),
}

# Found by these tests (answered 'internal' before kvtier/pools/layout.py and
# kvtier/daemon/service.py checked them); kept as cases of their own.
FORMERLY_INTERNAL = {
    "page id past int64": Case(lambda c: request(
        "store", pool=c.pool_id, keys=[GOOD_KEY], page_ids=[2**63]), REQUEST_ID, "bad_request",
        "page id"),
    "segment name with a NUL byte": Case(lambda c: register(c, segment="kvtier\x00pool"),
                                         REQUEST_ID, "bad_request", "bad segment name"),
    "layout too big to map": Case(lambda c: register(
        c, layout={**c.layout, "num_pages": 2**63 - 1, "page_stride_bytes": 0}), REQUEST_ID,
        "bad_request", "num_pages"),
}


def encode(body: bytes | dict | list) -> bytes:
    return pack_frame(body if isinstance(body, bytes) else msgspec.msgpack.encode(body))


def assert_error(reply: m._Reply, case: Case) -> None:
    assert isinstance(reply, m.Error), reply
    assert (reply.id, reply.code) == (case.reply_id, case.code), reply
    assert case.says in reply.message, reply.message
    assert len(reply.message.split()) >= 4  # a sentence, not a bare code


@pytest.mark.parametrize("case", [*UNDECODABLE.values(), *REFUSED.values(),
                                  *FORMERLY_INTERNAL.values()],
                         ids=[*UNDECODABLE, *REFUSED, *FORMERLY_INTERNAL])
def test_bad_request_gets_an_error_reply_and_the_connection_carries_on(raw: RawPool,
                                                                       case: Case) -> None:
    raw.conn.send_raw(encode(case.body(raw)))

    assert_error(raw.conn.reply(), case)
    assert raw.conn.call(verb="ping", id=REQUEST_ID + 1) == m.Pong(REQUEST_ID + 1)
    reply = raw.conn.call(verb="lookup", id=REQUEST_ID + 2, pool=raw.pool_id, keys=[GOOD_KEY])
    assert isinstance(reply, m.LookupTiersReply)


def test_many_bad_requests_in_one_write_get_one_reply_each(raw: RawPool) -> None:
    refused = {1000 + i: case for i, case in enumerate(REFUSED.values())}
    frames = [encode(case.body(raw)) for case in UNDECODABLE.values()]
    frames += [encode({**case.body(raw), "id": request_id}) for request_id, case in refused.items()]
    raw.conn.send_raw(b"".join(frames))

    replies = [raw.conn.reply() for _ in frames]  # copies run in a pool: any order

    assert sorted(r.id for r in replies) == [0] * len(UNDECODABLE) + sorted(refused)
    for reply in replies:
        if reply.id:
            case = refused[reply.id]
            assert_error(reply, Case(case.body, reply.id, case.code, case.says))
        else:
            assert reply.code == "bad_request" and "undecodable" in reply.message


def test_unpin_of_another_connections_lease_is_refused(raw: RawPool,
                                                       bystander: Bystander) -> None:
    lease, missing = bystander.client.pin(bystander.handle, bystander.keys, ttl_s=3600.0)
    assert missing == []
    try:
        reply = raw.conn.call(verb="unpin", id=REQUEST_ID, lease=lease)

        assert_error(reply, Case(lambda c: b"", REQUEST_ID, "bad_request",
                                 f"no live lease {lease} on this connection"))
        assert bystander.client.stats()["num_leases"] == 1
    finally:
        bystander.client.unpin(lease)
    assert bystander.client.stats()["num_leases"] == 0


@pytest.mark.parametrize("length", [DEFAULT_MAX_FRAME_BYTES + 1, 2**31, 2**32 - 1])
def test_oversized_frame_is_refused_before_any_allocation(daemon, raw: RawPool,
                                                          length: int) -> None:
    peak_before = daemon.peak_virtual_bytes()

    raw.conn.send_raw(length.to_bytes(4, "big") + b"\x00" * 64)

    reply = raw.conn.reply()
    assert isinstance(reply, m.Error) and (reply.id, reply.code) == (0, "frame_too_large")
    assert (f"frame of {length} bytes exceeds the {DEFAULT_MAX_FRAME_BYTES}-byte cap"
            in reply.message)
    assert raw.conn.closed_by_peer()
    assert daemon.peak_virtual_bytes() - peak_before < 256 << 20  # no 2 GiB buffer, ever


def test_frames_before_an_oversized_one_are_still_answered(raw: RawPool) -> None:
    raw.conn.send_raw(encode(request("ping")) + (2**31).to_bytes(4, "big"))

    assert raw.conn.reply() == m.Pong(REQUEST_ID)
    assert raw.conn.reply().code == "frame_too_large"
    assert raw.conn.closed_by_peer()


@pytest.mark.parametrize("cut", [1, 3, 4, 10])
def test_connection_dropped_mid_frame_is_forgotten(daemon, raw: RawPool, cut: int) -> None:
    frame = encode(request("store", pool=raw.pool_id, keys=[GOOD_KEY], page_ids=[0]))

    raw.conn.send_raw(frame[:cut])
    raw.conn.close()

    with daemon.client("after-drop") as client:
        harness.wait_until(lambda: [c["name"] for c in client.stats()["clients"]]
                           == ["bystander", "after-drop"], "the dropped connection to go")
        assert client.stats()["num_leases"] == 0
