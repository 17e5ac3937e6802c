"""Soak phase `fuzz`: valid and invalid frames over several connections at one daemon.

>= 100,000 frames (valid requests, bad values, random msgpack, random bytes, truncated frames,
oversized length prefixes); the daemon must keep its pid and answer every connection.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

import msgspec
import psutil

from kvtier.client import SegmentPool
from kvtier.ipc import messages as m
from kvtier.ipc.frames import DEFAULT_MAX_FRAME_BYTES, LENGTH_PREFIX_BYTES, pack_frame, recv_frame
from soak_phases.common import (
    LAYOUT,
    NAMESPACE,
    PAGE_BYTES,
    Figures,
    key_of,
    running_daemon,
    serve_args,
)

# Mostly verbs answered on the event loop: the copy-pool verbs cost ~10x more daemon time each,
# and 100,000 frames must fit in seconds on 2 cores.
VALID_VERBS = ("ping", "lookup", "pin", "hello", "stats", "store", "recall", "delete", "prefetch")
VALID_VERB_WEIGHTS = (30, 40, 10, 5, 1, 4, 4, 4, 2)


class FuzzFrames:
    """Generated request bodies: valid, structurally valid with bad values, garbage."""

    BAD_INTS = (-1, 0, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 10**6)
    BAD_KEYS = (b"", b"x" * 15, b"y" * 17, b"z" * 4096)

    def __init__(self, rng: random.Random, pool_id: int, segment: str) -> None:
        self.rng = rng
        self.pool_id = pool_id
        self.segment = segment
        self.keys = [key_of("fuzz", i) for i in range(64)]
        self.next_id = 1
        self.namespace = msgspec.structs.asdict(m.NamespaceSpec(
            NAMESPACE.model_id, NAMESPACE.dtype, NAMESPACE.layout, 16, PAGE_BYTES))
        self.layout = {f: getattr(LAYOUT, f) for f in m.LayoutSpec.__struct_fields__}

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def valid(self) -> dict:
        rng, keys = self.rng, self.rng.sample(self.keys, self.rng.randint(1, 4))
        verb = rng.choices(VALID_VERBS, VALID_VERB_WEIGHTS)[0]
        fields: dict = {"verb": verb, "id": self._id()}
        if verb == "hello":
            fields.update(version=m.PROTOCOL_VERSION, client_name="fuzz")
        elif verb != "ping" and verb != "stats":
            fields.update(pool=self.pool_id, keys=keys)
        if verb in ("store", "recall"):
            fields["page_ids"] = rng.sample(range(LAYOUT.num_pages), len(keys))
        if verb == "pin":
            fields["ttl_s"] = 0.5
        return fields

    def bad_value(self) -> dict:
        rng = self.rng
        fields = self.valid()
        choice = rng.randrange(9)
        if choice == 0:
            fields["id"] = rng.choice(self.BAD_INTS + ("x", None, 1.5))
        elif choice == 1 and "keys" in fields:
            fields["keys"] = [rng.choice(self.BAD_KEYS) for _ in range(rng.randint(1, 3))]
        elif choice == 2 and "pool" in fields:
            fields["pool"] = rng.choice(self.BAD_INTS + ("pool", [], None))
        elif choice == 3:
            fields["page_ids"] = [rng.choice(self.BAD_INTS) for _ in range(rng.randint(0, 5))]
            fields.setdefault("pool", self.pool_id)
            fields.setdefault("keys", self.keys[:3])
            fields["verb"] = rng.choice(("store", "recall"))
        elif choice == 4:
            fields = {"verb": "pin", "id": self._id(), "pool": self.pool_id, "keys": self.keys[:2],
                      "ttl_s": rng.choice((-1.0, float("nan"), float("inf"), 1e300, "x"))}
        elif choice == 5:
            namespace, layout = dict(self.namespace), dict(self.layout)
            target = rng.choice((namespace, layout))
            target[rng.choice(list(target))] = rng.choice(self.BAD_INTS + ("", "bogus", None))
            fields = {"verb": "register_pool", "id": self._id(), "namespace": namespace,
                      "layout": layout, "segment": rng.choice((
                          self.segment, "", "..", "../etc/passwd", "a\x00b", "kvtier-none"))}
        elif choice == 6:
            fields["verb"] = rng.choice(("nope", "", "STORE", 7, None))
        elif choice == 7:
            fields[rng.choice(("extra", "verb_", "size"))] = rng.randint(0, 9)
        elif choice == 8 and rng.random() < 0.01:  # rare: each such frame is 1.2 MB
            fields = {"verb": "lookup", "id": self._id(), "pool": self.pool_id,
                      "keys": [self.keys[0]] * (m.MAX_KEYS_PER_REQUEST + 1)}
        return fields

    def random_value(self, depth: int = 0) -> object:
        rng = self.rng
        kind = rng.randrange(8 if depth < 2 else 5)
        if kind == 0:
            return rng.choice(self.BAD_INTS)
        if kind == 1:
            return rng.random() * 1e9
        if kind == 2:
            return rng.randbytes(rng.randrange(20))
        if kind == 3:
            return "".join(rng.choice("ab\x00é{}") for _ in range(rng.randrange(8)))
        if kind == 4:
            return rng.choice((None, True, False))
        if kind == 5:
            return [self.random_value(depth + 1) for _ in range(rng.randrange(4))]
        return {str(self.random_value(depth + 1)): self.random_value(depth + 1)
                for _ in range(rng.randrange(4))}

    def body(self) -> tuple[str, bytes]:
        """(kind, frame body) for one frame."""
        roll = self.rng.random()
        if roll < 0.3:
            return "valid", msgspec.msgpack.encode(self.valid())
        if roll < 0.65:
            return "bad_value", msgspec.msgpack.encode(self.bad_value())
        if roll < 0.85:
            return "random_msgpack", msgspec.msgpack.encode(self.random_value())
        return "random_bytes", self.rng.randbytes(self.rng.randrange(48))


class FuzzConnection:
    """A raw socket with a pool registered, for frames the client library never sends."""

    def __init__(self, socket_path: Path, segment: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(str(socket_path))
        self.send([msgspec.msgpack.encode({"verb": "hello", "id": 1, "version": 1})])
        self.reply()
        self.send([msgspec.msgpack.encode({
            "verb": "register_pool", "id": 2, "segment": segment,
            "namespace": msgspec.structs.asdict(m.NamespaceSpec(
                NAMESPACE.model_id, NAMESPACE.dtype, NAMESPACE.layout, 16, PAGE_BYTES)),
            "layout": {f: getattr(LAYOUT, f) for f in m.LayoutSpec.__struct_fields__}})])
        self.pool_id = self.reply().pool

    def send(self, bodies: list[bytes], tail: bytes = b"") -> None:
        self.sock.sendall(b"".join(pack_frame(body) for body in bodies) + tail)

    def reply(self) -> m._Reply:
        return m.reply_decoder.decode(recv_frame(self.sock, DEFAULT_MAX_FRAME_BYTES))

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return True

    def close(self) -> None:
        self.sock.close()


def phase_fuzz(work: Path, num_frames: int, seed: int) -> Figures:
    """Valid and invalid frames over several connections at one daemon, which must survive."""
    socket_path = work / "fz.sock"
    rng = random.Random(seed)
    figures: Figures = {"frames_sent": 0, "replies": 0, "error_replies": 0, "internal_errors": 0,
                        "malformed_replies": 0, "truncated_frames": 0, "oversized_frames": 0,
                        "reconnects": 0, "unanswered_at_hangup": 0,
                        "daemon_restarts_needed": 0}
    kinds: dict[str, int] = {}
    internal_messages: dict[str, int] = {}
    with running_daemon(socket_path, *serve_args(work / "fz-disk", "8MiB", "32MiB")) as daemon, \
            SegmentPool(LAYOUT) as pool:
        pid = daemon.pid
        rss_before = psutil.Process(pid).memory_info().rss
        connections = [FuzzConnection(socket_path, pool.segment.name) for _ in range(4)]
        generator = FuzzFrames(rng, connections[0].pool_id, pool.segment.name)
        started = time.monotonic()
        try:
            while figures["frames_sent"] < num_frames:
                slot = rng.randrange(len(connections))
                connection = connections[slot]
                generator.pool_id = connection.pool_id
                bodies = []
                for _ in range(256):
                    kind, body = generator.body()
                    kinds[kind] = kinds.get(kind, 0) + 1
                    bodies.append(body)
                ending = rng.choices(("none", "truncated", "oversized"), (90, 5, 5))[0]
                tail = b""
                if ending == "truncated":
                    cut = msgspec.msgpack.encode(generator.valid())
                    tail = pack_frame(cut)[: rng.randrange(1, LENGTH_PREFIX_BYTES + len(cut))]
                elif ending == "oversized":
                    tail = rng.choice((DEFAULT_MAX_FRAME_BYTES + 1, 2**31, 2**32 - 1)).to_bytes(
                        LENGTH_PREFIX_BYTES, "big")
                connection.send(bodies, tail)
                figures["frames_sent"] += len(bodies) + (ending != "none")
                expected = len(bodies) + (ending == "oversized")
                for answered in range(expected):
                    try:
                        reply = connection.reply()
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        figures["malformed_replies"] += 1
                        continue
                    except ConnectionError:
                        if ending != "oversized":
                            raise
                        # The daemon hung up on the oversized frame: replies of requests still
                        # in its copy threads are dropped (see docs/reliability.md).
                        figures["unanswered_at_hangup"] += expected - answered
                        break
                    figures["replies"] += 1
                    if isinstance(reply, m.Error):
                        figures["error_replies"] += 1
                        if reply.code == "internal":
                            figures["internal_errors"] += 1
                            reason = reply.message.split(":")[1].strip()
                            internal_messages.setdefault(reason, [0, reply.message[:160]])
                            internal_messages[reason][0] += 1
                if ending != "none":
                    figures[f"{ending}_frames"] += 1
                    if ending == "oversized" and not connection.closed_by_peer():
                        figures["malformed_replies"] += 1  # it should have hung up
                    connection.close()
                    connections[slot] = FuzzConnection(socket_path, pool.segment.name)
                    figures["reconnects"] += 1
            elapsed_s = time.monotonic() - started
            for connection in connections:
                connection.send([msgspec.msgpack.encode({"verb": "ping", "id": 9})])
                if not isinstance(connection.reply(), m.Pong):
                    figures["daemon_restarts_needed"] = 1
        finally:
            for connection in connections:
                connection.close()
        with daemon.client("after-fuzz") as client:
            client.ping()
            figures["check_problems"] = len(client.check())
        if daemon.pid != pid or not daemon.running:
            figures["daemon_restarts_needed"] = 1
        figures["frames_per_s"] = round(figures["frames_sent"] / elapsed_s)
        figures["rss_growth_mib"] = (psutil.Process(pid).memory_info().rss - rss_before) >> 20
        figures["frame_kinds"] = kinds
        figures["internal_error_kinds"] = internal_messages
    return figures
