"""Soak phase `attacks`: one client's load attacks, against a neighbour's ping (issue #24).

One daemon (host tier only, 128 MiB, Prometheus endpoint on) and a neighbour process that pings
it in a loop the whole phase. Each attack runs from this process for its own window, and the
neighbour's ping p50/p99/max are printed for a quiet window just before it ("without") and for
the attack's window ("with"), measured in the same run. The attacks: a 65,536-page store,
16 pipelined 65,536-key lookups, 16 pipelined 65,536-key pins (then unpinned), as many pins
left to the daemon by a client that disconnects holding them, and 16 looping Prometheus
scrapers. The daemon's RSS is read before the store, after it and after its pages
are deleted (what it gave back).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import numpy as np
import psutil

import kvtier
from kvtier.client import Client, SharedPool
from kvtier.ipc import messages as m
from kvtier.ipc.frames import pack_frame, recv_frame
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout
from kvtier.testing.daemon_process import DaemonProcess, serve_argv
from kvtier.testing.neighbour import Neighbour
from soak_phases.common import Figures, key_of, progress

NUM_KEYS = 65_536  # kvtier.ipc.messages.MAX_KEYS_PER_REQUEST
NUM_PIPELINED = 16
NUM_SCRAPERS = 16
QUIET_S = 2.0
PING_INTERVAL_S = 0.005
# Tiny pages (1 layer, 16 tokens, 1 head of 8 dims: 512 bytes): the attack is the number of keys,
# not bytes; 65,536 of them are 32 MiB.
LAYOUT = PoolLayout.page_first(NUM_KEYS, 1, 16, 1, 8, "float16")
NAMESPACE = Namespace("soak-attacks", "float16", "page-first", 16, LAYOUT.page_bytes)


class Raw:
    """A bare connection, for pipelining what `Client` would send one at a time."""

    def __init__(self, socket_path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(600)
        self.sock.connect(str(socket_path))
        self._ids = iter(range(1, 1 << 62))
        self.call(m.Hello(0, m.PROTOCOL_VERSION, "attacker"))
        reply = self.call(m.OpenNamespace(0, m.NamespaceSpec(**{
            name: getattr(NAMESPACE, name) for name in m.NamespaceSpec.__struct_fields__})))
        assert isinstance(reply, m.PoolReply), reply
        self.pool = reply.pool

    def pipeline(self, requests: list[m._Request]) -> list[m._Reply]:
        frames = b"".join(pack_frame(m.encoder.encode(msgspec.structs.replace(
            r, id=next(self._ids)))) for r in requests)
        self.sock.sendall(frames)
        return [m.reply_decoder.decode(recv_frame(self.sock, 1 << 30)) for _ in requests]

    def call(self, request: m._Request) -> m._Reply:
        return self.pipeline([request])[0]

    def close(self) -> None:
        self.sock.close()


def phase_attacks(work: Path, quick: bool = False) -> Figures:
    """The four attacks, each with the neighbour's figures without and with it (--quick: 4
    pipelined requests instead of 16, 2 s of scrapers instead of 5, 1 s quiet windows)."""
    num_pipelined = 4 if quick else NUM_PIPELINED
    quiet_s = 1.0 if quick else QUIET_S
    socket_path = work / "attacks" / "k.sock"
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    keys = [key_of("attack", i) for i in range(NUM_KEYS)]
    windows: dict[str, tuple[float, float, float]] = {}  # attack: (quiet start, start, end)
    figures: Figures = {}
    # --no-disk: host only, and nothing written to the default disk directory (a user's own
    # daemon may hold it)
    with this_trees_daemon(socket_path, "--host-capacity", "128MiB", "--no-prefault", "--no-disk",
                           "--metrics-port", str(port)) as daemon:
        process = psutil.Process(daemon.pid)
        neighbour = Neighbour(socket_path, PING_INTERVAL_S)
        pool = SharedPool(LAYOUT)
        client = Client(socket_path, client_name="attacker")
        raw = Raw(socket_path)
        try:
            handle = pool.register(client, NAMESPACE)
            pool.pages[:] = np.random.default_rng(0).integers(0, 256, pool.pages.shape,
                                                              dtype=np.uint8)

            def run(name: str, attack: Callable[[], None]) -> None:
                quiet = time.monotonic()
                time.sleep(quiet_s)  # the neighbour's figures without the attack
                started = time.monotonic()
                attack()
                windows[name] = (quiet, started, time.monotonic())
                progress(f"attacks: {name} took {windows[name][2] - started:.1f} s")

            figures["rss_before_mib"] = process.memory_info().rss >> 20
            run("store_65536_pages", lambda: _expect_ok(
                client.store(handle, keys, range(NUM_KEYS)).result()))
            figures["rss_after_store_mib"] = process.memory_info().rss >> 20
            run(f"lookup_65536_keys_x{num_pipelined}", lambda: _expect_found(raw.pipeline(
                [m.Lookup(0, raw.pool, keys)] * num_pipelined)))
            run(f"pin_65536_keys_x{num_pipelined}", lambda: _pin_and_unpin(raw, num_pipelined))
            run(f"pin_65536_keys_x{num_pipelined}_then_disconnect", lambda: _pin_and_disconnect(
                socket_path, client, num_pipelined))
            run(f"scrapers_x{NUM_SCRAPERS}", lambda: _scrape(f"http://127.0.0.1:{port}/metrics",
                                                             2.0 if quick else 5.0))
            client.delete(handle, keys)
            # Housekeeping (every second) gives freed heap back after large requests.
            time.sleep(3.0)
            figures["rss_after_delete_mib"] = process.memory_info().rss >> 20
        finally:
            neighbour.stop()
            raw.close()
            client.close()
            pool.close()
        for name, (quiet, started, ended) in windows.items():
            figures[name] = {"without": neighbour.percentiles(quiet, started),
                             "with": neighbour.percentiles(started, ended),
                             "attack_s": round(ended - started, 2)}
        figures["daemon_restarts_needed"] = 0 if daemon.running else 1
    return figures


@contextmanager
def this_trees_daemon(socket_path: Path, *args: str) -> Iterator[DaemonProcess]:
    """A daemon of the kvtier this process imported (not the one installed, which
    `DaemonProcess.start` runs with `python -I`): the attacks measure this tree's daemon."""
    # The child inherits the environment; the other phases run `python -I`, which ignores it.
    os.environ["PYTHONPATH"] = str(Path(kvtier.__file__).resolve().parents[1])
    daemon = DaemonProcess(socket_path, serve_argv(socket_path, *args, isolated=False))
    try:
        daemon.wait_ready(60)
        yield daemon
    finally:
        if daemon.running:
            try:
                daemon.stop(30)
            finally:
                if daemon.running:
                    daemon.kill()


def _pin_and_unpin(raw: Raw, num_pipelined: int) -> None:
    replies = raw.pipeline([m.Pin(0, raw.pool, [key_of("attack", i) for i in range(NUM_KEYS)],
                                  60.0)] * num_pipelined)
    leases = [r.lease for r in replies if isinstance(r, m.PinReply)]
    assert len(leases) == num_pipelined, replies[0]
    raw.pipeline([m.Unpin(0, lease) for lease in leases])


def _pin_and_disconnect(socket_path: Path, client: Client, num_pipelined: int) -> None:
    """Pin from a connection of its own and close it holding the leases; until the daemon
    has ended them (what its stats count)."""
    holder = Raw(socket_path)
    replies = holder.pipeline([m.Pin(0, holder.pool, [key_of("attack", i)
                                                      for i in range(NUM_KEYS)], 60.0)]
                              * num_pipelined)
    assert all(isinstance(r, m.PinReply) for r in replies), replies[0]
    holder.close()
    deadline = time.monotonic() + 60.0
    while client.stats()["num_leases"] and time.monotonic() < deadline:
        time.sleep(0.01)


def _scrape(url: str, duration_s: float) -> None:
    deadline = time.monotonic() + duration_s
    counts = [0] * NUM_SCRAPERS

    def loop(index: int) -> None:
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=30) as response:
                response.read()
            counts[index] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(NUM_SCRAPERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    progress(f"attacks: {sum(counts)} scrapes")


def _expect_ok(result: object) -> None:
    assert result.ok, result


def _expect_found(replies: list[m._Reply]) -> None:
    for reply in replies:
        assert isinstance(reply, m.LookupTiersReply) and reply.num_prefix == NUM_KEYS, reply


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":  # cd bench && python -m soak_phases.attacks: this phase alone
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvt-") as work:
        print(json.dumps(phase_attacks(Path(work)), indent=1))
    os._exit(0)
