"""Thousands of generated bad frames at one live daemon; afterwards a good client still works.

Hypothesis generates batches of frames: random bytes, random msgpack values, dicts with a real
(or made-up) verb and random or plausible field values, frames cut short (then the connection
hangs up), and length prefixes over the cap (the daemon answers and hangs up). They go out over
a few connections, each with a pool registered; replies are read as they come and must all be
well-formed replies, and after each batch every connection must still answer a ping (or have
been closed by the daemon, and is then replaced).
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvtier.ipc import messages as m
from kvtier.ipc.frames import DEFAULT_MAX_FRAME_BYTES, LENGTH_PREFIX_BYTES, pack_frame
from kvtier.testing import daemon as harness

NUM_CONNECTIONS = 3
NUM_EXAMPLES = 110
FRAMES_PER_EXAMPLE = 100
MIN_FRAMES = 10_000
SENTINEL_BASE_ID = 1 << 62
READ_TIMEOUT_S = 30.0

REQUEST_TYPES = m.Request.__args__
OWN_POOL = "own pool"  # replaced, at send time, by the pool id of the connection it goes out on
FUZZ_LAYOUT = harness.make_layout("page-first", 16)
FUZZ_NAMESPACE = harness.namespace_spec(harness.namespace_for(FUZZ_LAYOUT, "fuzz"))
FUZZ_LAYOUT_FIELDS = harness.layout_spec(FUZZ_LAYOUT)

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=20))
msgpack_values = st.recursive(
    scalars, lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=6)


@dataclass(frozen=True)
class Frame:
    """What to send: `data`, or `request` encoded on the connection it goes out on."""

    data: bytes = b""
    request: dict | None = None
    then_hang_up: bool = False  # a frame cut short: we close the connection after it
    oversized: bool = False  # the daemon answers and closes the connection

    def encode(self, pool_id: int) -> bytes:
        if self.request is None:
            return self.data
        request = {name: pool_id if value == OWN_POOL else value
                   for name, value in self.request.items()}
        return pack_frame(msgspec.msgpack.encode(request))


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """Draw from one of the strategies, picked in proportion to its weight."""
    picks = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(picks).flatmap(lambda strategy: strategy)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    return weighted((4, good), (1, bad))


def mutations(base: dict) -> st.SearchStrategy[dict]:
    """`base` as is, or with one field set to a random value."""
    return mostly(st.just(base), st.builds(lambda name, value: {**base, name: value},
                                           st.sampled_from(sorted(base)), msgpack_values))


def frame_strategy(segment: str) -> st.SearchStrategy[Frame]:
    """Frames of every kind; plausible requests name `segment`, a real pool segment."""
    plausible = {
        "id": st.integers(-2, 2**64 - 1),
        "pool": mostly(st.just(OWN_POOL), st.integers(0, 2**64 - 1)),
        "keys": st.lists(mostly(st.binary(min_size=16, max_size=16), st.binary(max_size=17)),
                         max_size=6),
        "page_ids": st.lists(mostly(st.integers(0, 15), st.integers(-(2**63), 2**64 - 1)),
                             max_size=6),
        "parent_key": mostly(st.none(), st.binary(min_size=15, max_size=17)),
        "ttl_s": st.floats(allow_nan=True),
        "lease": st.integers(0, 10),
        "version": mostly(st.just(m.PROTOCOL_VERSION), st.integers(-(2**63), 2**64 - 1)),
        "segment": mostly(st.just(segment), st.text(max_size=24)),
        "namespace": mutations(FUZZ_NAMESPACE),
        "layout": mutations(FUZZ_LAYOUT_FIELDS),
        "verify_bytes": st.booleans(),
        "client_name": st.text(max_size=20),
        # Without CuPy (CI) any handle is refused; with it, random handles must fail cleanly.
        "cuda_ipc_handle": mostly(st.none(), st.binary(max_size=72)),
        "cuda_device": st.integers(-1, 2**31),
        "size_bytes": st.integers(0, 2**64 - 1),
        "cuda_ipc_offset": mostly(st.just(0), st.integers(-(2**63), 2**64 - 1)),
        "cuda_pci_bus_id": mostly(st.just(""), st.text(max_size=16)),
        "descriptor": mostly(st.just(False), st.booleans()),
    }
    # rotate: two of each (out, in), as for store and recall
    plausible.update({f"{side}_{name}": plausible[name] for side in ("out", "in")
                      for name in ("keys", "page_ids")})

    @st.composite
    def request_dicts(draw: st.DrawFn) -> dict:
        """A request of a real verb with fields of the right types, then maybe spoiled:
        a field dropped, one set to a random value, one added, or the verb made up."""
        request_type = draw(st.sampled_from(REQUEST_TYPES))
        request = {"verb": request_type.__struct_config__.tag}
        request.update({name: draw(plausible[name]) for name in request_type.__struct_fields__})
        spoil = draw(st.sampled_from(["none"] * 4 + ["drop", "retype", "add", "verb"]))
        name = draw(st.sampled_from(sorted(request)))
        if spoil == "drop":
            del request[name]
        elif spoil == "retype":
            request[name] = draw(msgpack_values)
        elif spoil == "add":
            request[draw(st.sampled_from(sorted(plausible)) | st.text(max_size=8))] = draw(
                msgpack_values)
        elif spoil == "verb":
            request["verb"] = draw(st.text(max_size=12))
        return request

    bodies = st.one_of(st.binary(max_size=64), msgpack_values.map(msgspec.msgpack.encode),
                       request_dicts().map(msgspec.msgpack.encode))
    complete = weighted((1, bodies.map(lambda body: Frame(pack_frame(body)))),
                        (3, request_dicts().map(lambda request: Frame(request=request))))
    cut_short = st.tuples(bodies, st.integers(1, 80)).map(
        lambda cut: Frame(pack_frame(cut[0])[: min(cut[1], LENGTH_PREFIX_BYTES + len(cut[0]) - 1)],
                          then_hang_up=True))
    oversized = st.integers(DEFAULT_MAX_FRAME_BYTES + 1, 2**32 - 1).map(
        lambda length: Frame(length.to_bytes(LENGTH_PREFIX_BYTES, "big"), oversized=True))
    # Few frames that end their connection: each costs a reconnect.
    return weighted((18, complete), (1, cut_short), (1, oversized))


@dataclass
class Tally:
    frames_sent: int = 0
    reconnects: int = 0
    codes: collections.Counter = field(default_factory=collections.Counter)
    internal_errors: list[str] = field(default_factory=list)



@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.DaemonProcess]:
    """The test daemon, with room for every namespace the fuzzed frames register: all the
    connections are this one process's, whose share (daemon.max_namespaces_per_peer, 64) they
    would fill within a few hundred frames, and every reconnection would then be refused."""
    with harness.running_daemon(tmp_path_factory.mktemp("disk") / "disk",
                                "--max-namespaces-per-peer", "100000") as process:
        yield process


class FuzzConnection:
    """A raw connection with a pool registered, decoding replies as they arrive."""

    def __init__(self, socket_path: str, segment: str, namespace: dict, layout: dict,
                 tally: Tally) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.alive = True  # False once the daemon hung up (or refused our bytes)
        self.received: list[m._Reply] = []  # every reply, in arrival order
        self._buffer = bytearray()
        self._replies: collections.deque[m._Reply] = collections.deque()
        self._tally = tally
        try:
            self.sock.settimeout(READ_TIMEOUT_S)
            self.sock.connect(socket_path)
            self.sock.sendall(pack_frame(msgspec.msgpack.encode(
                {"verb": "register_pool", "id": 1, "namespace": namespace, "segment": segment,
                 "layout": layout})))
            registered = self._next_reply()
            assert isinstance(registered, m.PoolReply), \
                f"a fresh connection's register_pool was answered {registered!r}"
        except BaseException:
            self.sock.close()  # not left to the garbage collector, which warns in a later test
            raise
        self.pool_id = registered.pool

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.alive = False
        self._pump()

    def sync(self, sentinel_id: int) -> None:
        """Ping and read every reply up to the pong (or to the daemon's hang-up)."""
        self.send(pack_frame(msgspec.msgpack.encode({"verb": "ping", "id": sentinel_id})))
        while (reply := self._next_reply()) is not None:
            if isinstance(reply, m.Pong) and reply.id == sentinel_id:
                return

    def read_to_end(self, since: int) -> None:
        """After an oversized prefix: the daemon answers frame_too_large (and the requests
        still in flight), then hangs up. `since`: how many replies had arrived before it."""
        while self._next_reply() is not None:
            pass
        codes = [getattr(reply, "code", None) for reply in self.received[since:]]
        assert "frame_too_large" in codes, self.received[since:]

    def _pump(self) -> None:
        """Take whatever bytes have arrived, without waiting."""
        self.sock.settimeout(0.0)  # with a timeout set, Python would poll before each recv
        try:
            while self.alive:
                try:
                    self._take(self.sock.recv(1 << 16))
                except BlockingIOError:
                    return
                except ConnectionResetError:
                    self._take(b"")
        finally:
            self.sock.settimeout(READ_TIMEOUT_S)

    def _next_reply(self) -> m._Reply | None:
        """The next reply, waiting for it; None once the daemon hung up and all are read."""
        while not self._replies and self.alive:
            try:
                self._take(self.sock.recv(1 << 16))
            except ConnectionResetError:
                self._take(b"")
        return self._replies.popleft() if self._replies else None

    def _take(self, chunk: bytes) -> None:
        if not chunk:
            self.alive = False
        buffer = self._buffer
        buffer += chunk
        while len(buffer) >= LENGTH_PREFIX_BYTES:
            end = LENGTH_PREFIX_BYTES + int.from_bytes(buffer[:LENGTH_PREFIX_BYTES], "big")
            if len(buffer) < end:
                return
            # must be well formed
            reply = m.reply_decoder.decode(bytes(buffer[LENGTH_PREFIX_BYTES:end]))
            del buffer[:end]
            self._count(reply)
            self._replies.append(reply)
            self.received.append(reply)

    def _count(self, reply: m._Reply) -> None:
        if isinstance(reply, m.Error):
            self._tally.codes[reply.code] += 1
            if reply.code == "internal":
                self._tally.internal_errors.append(reply.message)
        else:
            self._tally.codes[type(reply).__struct_config__.tag] += 1

    def close(self) -> None:
        self.sock.close()


def test_thousands_of_bad_frames_leave_the_daemon_serving(daemon, make_pool) -> None:
    fuzz_pool = make_pool(FUZZ_LAYOUT, named=True)
    tally = Tally()

    def connect() -> FuzzConnection:
        return FuzzConnection(str(daemon.socket_path), fuzz_pool.segment.name, FUZZ_NAMESPACE,
                              FUZZ_LAYOUT_FIELDS, tally)

    connections = [connect() for _ in range(NUM_CONNECTIONS)]
    sentinels = iter(range(SENTINEL_BASE_ID, SENTINEL_BASE_ID + 10**9))

    def replace(index: int) -> None:
        # The new one first: if it fails, Hypothesis replays the batch on connections that are
        # still open, and reports this failure rather than a send on a closed socket.
        fresh = connect()
        connections[index].close()
        connections[index] = fresh
        tally.reconnects += 1

    # No shrinking: each try replays whole batches against the live daemon; the failing batch
    # is reported as generated.
    @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(st.tuples(st.integers(0, NUM_CONNECTIONS - 1),
                                    frame_strategy(fuzz_pool.segment.name)),
                          min_size=FRAMES_PER_EXAMPLE, max_size=FRAMES_PER_EXAMPLE))
    def throw(batch: list[tuple[int, Frame]]) -> None:
        for index, frame in batch:
            connection = connections[index]
            num_received = len(connection.received)
            connection.send(frame.encode(connection.pool_id))
            tally.frames_sent += 1
            if frame.oversized:
                connection.read_to_end(since=num_received)
            if frame.then_hang_up or frame.oversized or not connection.alive:
                replace(index)
        for index, connection in enumerate(connections):
            connection.sync(next(sentinels))
            if not connection.alive:  # a frame closed it: the daemon must take a new one
                replace(index)
                connections[index].sync(next(sentinels))
                assert connections[index].alive

    try:
        throw()
    finally:
        for connection in connections:
            connection.close()

    assert tally.frames_sent >= MIN_FRAMES
    assert tally.codes["bad_request"] > 1000 and tally.codes["frame_too_large"] > 10
    assert tally.internal_errors == []  # bad input is the client's error, never 'internal'

    assert daemon.running

    rng = np.random.default_rng(30)
    good_layout = harness.make_layout("layer-first", 16)
    pool = make_pool(good_layout)
    with daemon.client("good-after-fuzz") as client:
        handle = pool.register(client, harness.namespace_for(good_layout, "good", "layer-first"))
        harness.fill_random(pool, rng, range(16))
        keys = harness.random_keys(rng, 8)
        stored = harness.snapshot(pool, range(8))
        assert client.store(handle, keys, range(8)).result().ok
        result = client.recall(handle, keys, range(8, 16)).result()
        assert result.ok
        np.testing.assert_array_equal(harness.snapshot(pool, range(8, 16)), stored)
        harness.wait_until(lambda: [c["name"] for c in client.stats()["clients"]]
                           == ["good-after-fuzz"], "the fuzz connections' sessions to end")
        assert client.stats()["num_leases"] == 0
        assert client.check() == []
        assert client.check(verify_bytes=True) == []
