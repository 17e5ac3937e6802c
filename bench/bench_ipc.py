"""Control-socket latency and pool copy throughput of a real kvtier daemon, beside the machine's own
limits.

Run:

    python bench/bench_ipc.py [--json] [--repeats 7] [--lookups 5000] [--seed 0] [--quick]
                              [--scrape-interval 0.1] [--no-metrics]

Starts `kvtier serve` as a child process (a socket and a disk directory under a fresh temporary
directory; host tier 1 GiB, pre-faulted as by default; disk tier on, write-back, so nothing is
evicted and no page reaches disk), waits for "kvtier ready" on its stderr, and always stops it
with SIGTERM and removes what it created. The client side is `Client` + `SharedPool`.

- lookup: round trip of `Client.lookup` of one present key, `--lookups` calls, beside a bare
  Unix-socket round trip of frames of the same sizes (a blocking echo server in a child process,
  blocking client socket), the two interleaved in blocks. `lookup_ratio` = lookup p50 / bare p50,
  target <= 2. Then the same with the client, the daemon and the echo server on one CPU
  (`lookup_ratio_one_cpu`, for reference): on a VM a round trip between CPUs pays for waking a
  halted virtual CPU, which moved `lookup_ratio` between 1.2 and 2.7 from run to run here, more
  than the whole software path costs. `loop_echo_*` (reference): the same frames answered by an
  echo server on the daemon's event loop (uvloop, an `asyncio.Protocol`, no other work),
  interleaved with the two: `loop_echo_ratio` = its p50 / the blocking echo's, the part of
  `lookup_ratio` any event-loop daemon pays on this machine. `raw_lookup_*` (reference): the
  same lookup frame written and read on a connection of its own with no `Client` (its hello
  and namespace handle by hand), interleaved too: the daemon's part of the lookup
  (`raw_lookup_ratio` = its p50 / the blocking echo's); the rest of `lookup_us_*` is the
  client's. `Client` polls the socket for a quick reply before sleeping on it
  (`kvtier.client.polling`); two more references, interleaved too: `lookup_blocking_*`, the
  same lookup by a client that never polls (`poll_us=0`: `lookup_blocking_ratio` = its p50 /
  the blocking echo's), and `poll_echo_*`, the echo's reply polled for the same way
  (`lookup_vs_poll_echo` = lookup p50 / its p50: the lookup against a bare round trip that
  saves the same wake-up). `threaded_lookups_per_s`: one-key lookups a second from
  `LOOKUP_THREADS` threads sharing one client (pipelined), beside the same from threads sharing
  the client that never polls (`threaded_lookups_blocking_per_s`), `THREADED_ROUNDS` rounds in
  turn, medians (`threaded_lookups_ratio` = polled / not). `request_lookup_us_*`: lookup of all
  the request's keys in one call.
- local lookup (the lookup plane): `Client.lookup` on a namespace handle (`open_namespace`),
  answered from the daemon's key index mapped into this process with no round trip:
  `local_lookup_us_*` for all the request's keys (256 in the full run; target <= 20 us p50),
  `local_lookup_16_us_*` for 16 (target <= 5 us), beside the socket lookup of the same keys.
  `index_publish_us_per_page` / `index_unpublish_us_per_page`: what the daemon spends per page
  stored / evicted keeping the index (the store's observer calls, rebuilds included, 10^5 pages
  into one namespace in stores of 64 pages, then each reported gone and the queue written, in
  this process; target <= 1 us; each index figure the median of `INDEX_UPKEEP_RUNS` runs: one
  run moved between 0.7 and 2 us on a busy VM); `index_churn_us_per_page`: at capacity, each
  page stored evicting one (both counted, rebuilds included: `index_churn_rebuilds`); beside
  `index_dict_insert_us_per_page` (the same entries put in a dict, as the page table does: the
  machine's own pace);
  `index_bytes_per_page`: the index's size over the pages it then holds; `index_stall_ms`:
  the longest the lookup plane held the store's lock (every request waits) while an index grew
  to 10^6 keys, published 64 at a time, each batch after a copy of its 64 16-KiB pages (as
  a store does): its publishes, rebuilds and beats. In
  that full index (`index_fill` of its slots), lookups of 256 and 16 held keys drawn at random:
  `full_table_lookup_us_p50`, `full_table_lookup_16_us_p50` (the same targets).
- metrics on vs off: three more daemons (64 MiB host, no disk), one with `--metrics-port` and
  a thread scraping it every `--scrape-interval` seconds, two without; one-key lookups against
  each and bare round trips, interleaved in blocks. `lookup_ratio_metrics_off` /
  `lookup_ratio_metrics_on` = each lookup p50 / bare p50; `metrics_on_off` = on p50 / off p50,
  beside `metrics_off_off` = the second metrics-off daemon's p50 / the first's: the noise
  between two identical daemons, which `metrics_on_off` should stay within. `histogram_observe_ns`:
  what recording one request's latency in the histogram costs (in this process, 10^6 calls), beside
  the lookup p50; `scrape_loop_us_*`: how long a scrape's stats snapshot held the daemon's event
  loop. `--no-metrics` skips.
- store / recall: one request of 4096 tokens of a 32-layer, 8-KV-head, 128-dim bfloat16 model in
  16-token pages (256 pages of 2 MiB: 512 MiB), stored from pool pages 0..255 in one `store` call
  and recalled into pool pages 256..511 in one `recall` call (timed: send to `result()`), the
  keys deleted after each repetition so every store is fresh. Pool layouts: `layer_first`
  (vLLM's per-layer `[2, num_pages, page_tokens, heads, dim]`, the headline) and `page_first`.
  Baseline, in the same repetition: `np.copyto` page by page of the same pool pages into a
  pre-faulted contiguous 512 MiB buffer (store), and from it into pages 256..511 (recall).
  Ratios are kvtier GB/s / baseline GB/s, target >= 0.7. Recalled bytes are verified once,
  outside timing.

One warm-up round of each measurement is excluded; workloads are seeded. GB = 1e9 bytes.
Throughput is of the median repetition; p50 / p99 are of per-call (lookup) or per-repetition
(store, recall) latency. `--quick`: 1024 tokens, 3 repeats, 1000 lookups (a smoke test).
`--json` prints exactly one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.client import Client, PoolHandle, SharedPool, verbs
from kvtier.client.connection import MAX_REPLY_BYTES
from kvtier.client.polling import ReplyPoller
from kvtier.ipc import messages as m
from kvtier.ipc.frames import LENGTH_PREFIX_BYTES, frame_end, pack_frame
from kvtier.keys import Namespace, prefix_keys
from kvtier.pools.layout import PoolLayout
from kvtier.testing.daemon_process import DaemonProcess, serve_argv

MODEL = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
PAGE_TOKENS = 16
LAYOUTS: dict[str, Callable[..., PoolLayout]] = {"layer_first": PoolLayout.layer_first,
                                                 "page_first": PoolLayout.page_first}
HEADLINE_LAYOUT = "layer_first"
LOOKUP_TARGET = 2.0  # lookup p50 / bare round trip p50, at most
LOCAL_LOOKUP_TARGET_US = 20.0  # a request's lookup (256 keys) from the index, p50, at most
LOCAL_LOOKUP_16_TARGET_US = 5.0  # 16 keys
INDEX_PAGE_TARGET_US = 1.0  # the daemon's index upkeep per page stored or evicted, at most
PUBLISH_BATCH_PAGES = 64  # pages a store commits at once (a 1024-token request of 16-token pages)
STALL_PAGES = 1_000_000  # keys an index grows to in `index_stall_s`, stored as pages of
STALL_PAGE_BYTES = 16 << 10
INDEX_UPKEEP_RUNS = 3  # the index figures are medians of this many runs
COPY_TARGET = 0.7  # kvtier GB/s / np.copyto GB/s, at least
LOOKUP_BLOCKS = 10  # lookup and bare round trips alternate in this many blocks each
LOOKUP_THREADS = 8  # threads sharing one client, their lookups pipelined
THREADED_ROUNDS = 3
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0

log_console = Console(stderr=True)

# A blocking echo server: for each request frame, one reply frame of a fixed size.
ECHO_SERVER = r"""
import socket, sys
path, reply_bytes = sys.argv[1], int(sys.argv[2])
reply = (reply_bytes - 4).to_bytes(4, "big") + b"x" * (reply_bytes - 4)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(1)
print("ready", flush=True)
conn, _ = listener.accept()
buf = bytearray(1 << 16)
view = memoryview(buf)
def recv_exactly(n):
    got = 0
    while got < n:
        k = conn.recv_into(view[got:n])
        if k == 0:
            raise SystemExit(0)
        got += k
while True:
    recv_exactly(4)
    recv_exactly(int.from_bytes(buf[:4], "big"))
    conn.sendall(reply)
"""


# The same echo on the daemon's event loop (uvloop where installed, as `kvtier serve` runs): an
# `asyncio.Protocol` answering each whole frame inside `data_received`, and nothing else. The
# floor of any daemon built on an event loop.
LOOP_ECHO_SERVER = r"""
import asyncio, sys
path, reply_bytes = sys.argv[1], int(sys.argv[2])
reply = (reply_bytes - 4).to_bytes(4, "big") + b"x" * (reply_bytes - 4)
class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, bytearray()
    def data_received(self, data):
        buffer = self.buffer
        buffer += data
        while len(buffer) >= 4 and len(buffer) >= 4 + int.from_bytes(buffer[:4], "big"):
            del buffer[:4 + int.from_bytes(buffer[:4], "big")]
            self.transport.write(reply)
async def main():
    await asyncio.get_running_loop().create_unix_server(Echo, path=path)
    print("ready", flush=True)
    await asyncio.Future()
try:
    import uvloop
except ImportError:
    asyncio.run(main())
else:
    uvloop.run(main())
"""


@dataclass(slots=True)
class Latencies:
    """Per-call seconds of one measurement."""

    samples_s: list[float]

    def p50_us(self) -> float:
        return float(np.percentile(self.samples_s, 50)) * 1e6

    def p99_us(self) -> float:
        return float(np.percentile(self.samples_s, 99)) * 1e6


def start_daemon(root: Path, host_bytes: int, disk_bytes: int,
                 extra_args: tuple[str, ...] = ()) -> DaemonProcess:
    """`kvtier serve` with write-back tiers under `root`, not waited for. Not `-I`: the daemon
    is this checkout's kvtier (perf_check's `--repo` puts another checkout on PYTHONPATH)."""
    socket_path = root / "kvtier.sock"
    argv = serve_argv(socket_path, "--host-capacity", str(host_bytes), "--disk-path",
                      str(root / "disk"), "--disk-capacity", str(disk_bytes), "--write-policy",
                      "write-back", "--log-level", "info", *extra_args, isolated=False)
    return DaemonProcess(socket_path, argv)


def wait_ready_s(daemon: DaemonProcess) -> float:
    """Seconds until `daemon` logged that it is ready (LaunchError if it died or took too long)."""
    started = time.perf_counter()
    daemon.wait_ready(READY_TIMEOUT_S)
    return time.perf_counter() - started


@contextlib.contextmanager
def echo_server(path: Path, reply_bytes: int, server: str = ECHO_SERVER):
    """A connected blocking socket to a child echo server (`server`: `ECHO_SERVER` or
    `LOOP_ECHO_SERVER`) that answers `reply_bytes` frames."""
    process = subprocess.Popen([sys.executable, "-c", server, str(path), str(reply_bytes)],
                               stdout=subprocess.PIPE, text=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo server did not start")
        sock.connect(str(path))
        yield sock, process.pid
    finally:
        sock.close()
        process.terminate()
        process.wait(10)


@contextlib.contextmanager
def raw_connection(socket_path: Path, namespace: Namespace):
    """A blocking socket to the daemon that speaks the protocol by hand (no `Client`), with a
    handle on `namespace` of its own: (socket, pool id)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(socket_path))
        handle = None
        for call in (verbs.hello(1, "bench-ipc-raw"), verbs.open_namespace(2, namespace)):
            sock.sendall(pack_frame(m.encoder.encode(call.request)))
            handle = call.parse(verbs.raise_if_error(m.reply_decoder.decode(read_frame(sock))))
        yield sock, handle.pool_id
    finally:
        sock.close()


def read_frame(sock: socket.socket) -> bytes:
    """The body of the next frame on `sock` (the only one in flight)."""
    data = bytearray()
    while (end := frame_end(data, 0, MAX_REPLY_BYTES)) is None:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        data += chunk
    return bytes(data[LENGTH_PREFIX_BYTES:end])


def bare_round_trip(sock: socket.socket, request: bytes, reply_bytes: int,
                    view: memoryview) -> None:
    sock.sendall(request)
    got = 0
    while got < reply_bytes:
        k = sock.recv_into(view[got:reply_bytes])
        if k == 0:
            raise ConnectionError("the echo server closed the connection")
        got += k


@contextlib.contextmanager
def on_one_cpu(*pids: int):
    """Every thread of this process and of `pids` on this process's first allowed CPU, for the
    block; their CPU sets as they were after it."""
    cpu = min(os.sched_getaffinity(0))
    tids = [int(tid) for pid in (os.getpid(), *pids) for tid in os.listdir(f"/proc/{pid}/task")]
    before = {tid: os.sched_getaffinity(tid) for tid in tids}
    try:
        for tid in tids:
            os.sched_setaffinity(tid, {cpu})
        yield
    finally:
        for tid, cpus in before.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)


def polled_round_trip(poller: ReplyPoller, sock: socket.socket, request: bytes,
                      reply_bytes: int) -> None:
    """`bare_round_trip` with the reply polled for as `Client` polls for a quick reply."""
    sock.sendall(request)
    got = 0
    while got < reply_bytes:
        k = len(poller.recv(reply_bytes - got, poll=True))
        if k == 0:
            raise ConnectionError("the echo server closed the connection")
        got += k


def timed_calls(call: Callable[[], object], count: int) -> list[float]:
    gc.collect()
    samples = []
    clock = time.perf_counter
    for _ in range(count):
        start = clock()
        call()
        samples.append(clock() - start)
    return samples


def bench_lookup(client: Client, handle: PoolHandle, keys: list[bytes], num_lookups: int,
                 root: Path, daemon_pid: int, socket_path: Path,
                 blocking_handle: PoolHandle, blocking_client: Client) -> dict[str, Latencies]:
    """One-key lookup (polled for, and by a client that never polls: `blocking_client`), the
    same lookup frame on a raw connection, and echo round trips of the same frame sizes
    (read blocking and polled), interleaved; then the same with every process on one CPU
    (`on_one_cpu`)."""
    key = [keys[0]]
    request = pack_frame(m.encoder.encode(m.Lookup(10**6, handle.pool_id, key)))
    reply_bytes = len(pack_frame(m.encoder.encode(m.LookupTiersReply(10**6, 1, ["host"]))))
    buffer = bytearray(1 << 16)
    view = memoryview(buffer)
    block = max(1, num_lookups // LOOKUP_BLOCKS)
    names = ("lookup", "lookup_blocking", "raw_lookup", "bare", "poll_echo", "loop_echo")
    samples: dict[str, list[float]] = {name: [] for name in names}
    one_cpu: dict[str, list[float]] = {name: [] for name in names}
    with (echo_server(root / "echo.sock", reply_bytes) as (sock, echo_pid),
          echo_server(root / "loop-echo.sock", reply_bytes, LOOP_ECHO_SERVER)
          as (loop_sock, loop_echo_pid),
          raw_connection(socket_path, handle.namespace) as (raw_sock, raw_pool_id)):
        raw_request = pack_frame(m.encoder.encode(m.Lookup(10**6, raw_pool_id, key)))
        raw_sock.sendall(raw_request)
        if read_frame(raw_sock) != m.encoder.encode(m.LookupTiersReply(10**6, 1, ["host"])):
            raise RuntimeError("the raw connection's lookup did not find the key in host")
        poller = ReplyPoller(sock)
        calls = {"lookup": lambda: client.lookup(handle, key),
                 "lookup_blocking": lambda: blocking_client.lookup(blocking_handle, key),
                 "raw_lookup": lambda: bare_round_trip(raw_sock, raw_request, reply_bytes, view),
                 "bare": lambda: bare_round_trip(sock, request, reply_bytes, view),
                 "poll_echo": lambda: polled_round_trip(poller, sock, request, reply_bytes),
                 "loop_echo": lambda: bare_round_trip(loop_sock, request, reply_bytes, view)}
        for call in calls.values():  # warm-up
            timed_calls(call, block)
        for _ in range(LOOKUP_BLOCKS):
            for name, call in calls.items():
                samples[name] += timed_calls(call, block)
        # On a VM, a round trip between CPUs pays for waking a halted virtual CPU, which varied
        # from run to run more than the whole software path costs; on one CPU it does not.
        with on_one_cpu(daemon_pid, echo_pid, loop_echo_pid):
            for _ in range(LOOKUP_BLOCKS):
                for name, call in calls.items():
                    one_cpu[name] += timed_calls(call, block)
    request_s = timed_calls(lambda: client.lookup(handle, keys), max(10, block // 5))  # warm-up
    request_s = timed_calls(lambda: client.lookup(handle, keys), max(100, num_lookups // 5))
    if client.lookup(handle, keys).num_prefix != len(keys):
        raise RuntimeError("request lookup did not find every stored key")
    names = client.open_namespace(handle.namespace)
    if (names.pool_id not in client.local_lookup_pool_ids
            or client.lookup(names, keys).num_prefix != len(keys)):
        raise RuntimeError("no lookup index mapped, or it misses stored keys")
    count = max(1000, num_lookups // 2)
    timed_calls(lambda: client.lookup(names, keys), count // 10)  # warm-up
    local_s = timed_calls(lambda: client.lookup(names, keys), count)
    local16_s = timed_calls(lambda: client.lookup(names, keys[:16]), count)
    return {**{name: Latencies(values) for name, values in samples.items()},
            **{f"{name}_one_cpu": Latencies(values) for name, values in one_cpu.items()},
            "request_lookup": Latencies(request_s), "local_lookup": Latencies(local_s),
            "local_lookup_16": Latencies(local16_s)}


def threaded_lookups_per_s(client: Client, handle: PoolHandle, key: list[bytes],
                           calls_per_thread: int) -> float:
    """One-key lookups a second from `LOOKUP_THREADS` threads sharing `client`."""
    failures: list[BaseException] = []

    def ask() -> None:
        try:
            for _ in range(calls_per_thread):
                if client.lookup(handle, key).num_prefix != len(key):
                    raise RuntimeError("a threaded lookup missed its key")
        except BaseException as exc:  # raised in the bench's thread
            failures.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(LOOKUP_THREADS)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if failures:
        raise failures[0]
    return LOOKUP_THREADS * calls_per_thread / elapsed


def bench_threaded_lookups(clients: dict[str, tuple[Client, PoolHandle]], key: list[bytes],
                           num_lookups: int) -> dict[str, float]:
    """`threaded_lookups_per_s` of each client, `THREADED_ROUNDS` rounds in turn (after a
    warm-up); the median rate of each."""
    calls = max(50, num_lookups // (2 * LOOKUP_THREADS))
    rates: dict[str, list[float]] = {name: [] for name in clients}
    for round_ in range(-1, THREADED_ROUNDS):
        for name, (client, handle) in clients.items():
            rate = threaded_lookups_per_s(client, handle, key, calls)
            if round_ >= 0:
                rates[name].append(rate)
    return {f"{name}_per_s": statistics.median(values) for name, values in rates.items()}


def table_lookups(segment: Any, keys: list[bytes], rng: np.random.Generator,
                  count: int = 2000) -> dict[str, float]:
    """Lookups of 256 and of 16 held keys, drawn at random, in a namespace's whole index as the
    daemon filled it (the one-request namespace of `bench_lookup` is a small, sparse table)."""
    from kvtier.key_index import IndexReader

    reader = IndexReader(segment._view.toreadonly(), segment.writer.layout)
    figures = {"index_fill": segment.writer.num_keys / segment.writer.layout.num_slots}
    for name, size in (("full_table_lookup_us", 256), ("full_table_lookup_16_us", 16)):
        requests = [[keys[i] for i in rng.choice(len(keys), size, replace=False)]
                    for _ in range(64)]
        if any(reader.longest_prefix(request) != size for request in requests):
            raise RuntimeError("the index misses keys it was given")
        calls = iter(range(count))
        samples = timed_calls(lambda: reader.longest_prefix(requests[next(calls) % 64]), count)
        figures[f"{name}_p50"] = Latencies(samples).p50_us()
    return figures


def median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over `runs` (dicts of the same keys)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


@contextlib.contextmanager
def lookup_plane(background_keys: int | None = None):
    """A daemon's lookup plane over a small embedded store, closed after the block; its indexes
    rebuilt off the store's lock from `background_keys` keys (the daemon's setting if None)."""
    from kvtier.config import DiskConfig, HostConfig, StoreConfig
    from kvtier.daemon.lookup_plane import BACKGROUND_KEYS, LookupPlane
    from kvtier.store.page_store import PageStore

    store = PageStore(StoreConfig(host=HostConfig(capacity_bytes=4 << 20, prefault=False),
                                  disk=DiskConfig(enabled=False)))
    try:
        plane = LookupPlane(store, BACKGROUND_KEYS if background_keys is None else background_keys)
        try:
            yield plane
        finally:
            plane.close()
    finally:
        store.close()


def new_entries(namespace: Namespace, num_pages: int, rng: np.random.Generator) -> list:
    """`num_pages` page-table entries of `namespace` under random keys."""
    from kvtier.store.pages import PageEntry

    return [PageEntry(namespace.fingerprint + rng.bytes(16), namespace) for _ in range(num_pages)]


def publish(plane, entries: list) -> None:
    """Publish `entries` as stores commit their pages: `PUBLISH_BATCH_PAGES` at a time."""
    for first in range(0, len(entries), PUBLISH_BATCH_PAGES):
        plane.pages_ready(entries[first:first + PUBLISH_BATCH_PAGES])


def index_upkeep(num_pages: int = 100_000) -> dict[str, float]:
    """Microseconds per page the daemon's lookup plane spends publishing and unpublishing keys
    (what the store's observer calls cost), and the index's bytes per page held."""
    namespace = Namespace("bench-index", "bfloat16", "page-first", PAGE_TOKENS, 1 << 21)
    rng = np.random.default_rng(1)
    entries = new_entries(namespace, num_pages, rng)
    # Every rebuild under the lock, on this thread: its whole work in the figures, and the
    # full table holding still for its lookups (`index_stall_ms` measures rebuilds off the lock).
    with lookup_plane(background_keys=sys.maxsize) as plane:
        gc.collect()
        start = time.perf_counter()
        publish(plane, entries)
        publish_s = time.perf_counter() - start
        size_bytes = plane.index_for(namespace)[2]
        full_table = table_lookups(plane._segments[namespace.fingerprint],
                                   [entry.scoped_key[16:] for entry in entries], rng)
        # A daemon at capacity: each store of 64 pages evicts 64 (the oldest), as many again.
        newer = new_entries(namespace, num_pages, rng)
        gc.collect()
        generation = plane.index_for(namespace)[1]
        start = time.perf_counter()
        for first in range(0, num_pages, PUBLISH_BATCH_PAGES):
            for entry in entries[first:first + PUBLISH_BATCH_PAGES]:
                plane.page_gone(entry)
            plane.pages_ready(newer[first:first + PUBLISH_BATCH_PAGES])
        churn_s = time.perf_counter() - start
        churn_rebuilds = plane.index_for(namespace)[1] - generation
        start = time.perf_counter()
        for entry in newer:  # one at a time, as evictions and deletes report them
            plane.page_gone(entry)
        plane.index_for(namespace)  # writes what is queued
        unpublish_s = time.perf_counter() - start
    # The same run's reference: putting the same entries in a dict, as the page table does.
    table: dict[bytes, object] = {}
    gc.collect()
    start = time.perf_counter()
    for entry in entries:
        table[entry.scoped_key] = entry
    dict_s = time.perf_counter() - start
    return {**full_table, "index_publish_us_per_page": publish_s / num_pages * 1e6,
            "index_dict_insert_us_per_page": dict_s / num_pages * 1e6,
            "index_unpublish_us_per_page": unpublish_s / num_pages * 1e6,
            "index_churn_us_per_page": churn_s / num_pages * 1e6,
            "index_churn_rebuilds": churn_rebuilds,
            "index_bytes_per_page": size_bytes / num_pages,
            "index_stall_ms": index_stall_s(STALL_PAGES) * 1e3}


def index_stall_s(num_pages: int) -> float:
    """The longest the lookup plane holds the store's lock while a namespace's index grows to
    `num_pages` keys, published as stores commit them: each publish, and each hold of its beat
    thread (which puts a rebuild done off the lock in place)."""
    namespace = Namespace("bench-rebuild", "bfloat16", "page-first", PAGE_TOKENS, 1 << 21)
    entries = new_entries(namespace, num_pages, np.random.default_rng(2))
    holds: list[float] = []

    with lookup_plane() as plane:
        store = plane._store
        call_locked = store.call_locked

        def timed_hold(work):
            start = time.perf_counter()
            try:
                return call_locked(work)
            finally:
                holds.append(time.perf_counter() - start)

        store.call_locked = timed_hold  # the beat thread's holds too
        # Each store copies its pages before it publishes them (off the lock, the GIL free):
        # small pages, the most keys per byte.
        source = np.ones(PUBLISH_BATCH_PAGES * STALL_PAGE_BYTES, np.uint8)
        copy = np.zeros_like(source)
        gc.collect()
        gc.freeze()  # the entries: a collection's pass over them is not the index's
        for first in range(0, num_pages, PUBLISH_BATCH_PAGES):
            np.copyto(copy, source)
            batch = entries[first:first + PUBLISH_BATCH_PAGES]
            store.call_locked(lambda: plane.pages_ready(batch))
        gc.unfreeze()
        return max(holds)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def scraping(port: int, interval_s: float):
    """A thread that scrapes http://127.0.0.1:`port`/metrics every `interval_s`, as Prometheus
    would; yields a list that counts the scrapes."""
    import urllib.request

    stop = threading.Event()
    scrapes: list[int] = []

    def loop() -> None:
        while not stop.wait(interval_s):  # the scrape period, not a synchronisation
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
                scrapes.append(len(reply.read()))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield scrapes
    finally:
        stop.set()
        thread.join(60)


def histogram_observe_ns() -> float:
    """Nanoseconds per `LatencyHistogram.observe`: what the daemon adds per request for metrics."""
    from kvtier.store.stats import LatencyHistogram

    histogram = LatencyHistogram()
    values = np.random.default_rng(0).lognormal(-10, 1, 1000).tolist()
    observe = histogram.observe
    start = time.perf_counter()
    for _ in range(1000):
        for value in values:
            observe(value)
    return (time.perf_counter() - start) / 1e6 * 1e9


def bench_metrics_cost(root: Path, num_lookups: int, scrape_interval_s: float) -> dict:
    """One-key lookups against a daemon with metrics off and one with metrics on (and scraped),
    and bare round trips, interleaved in blocks."""
    port = free_port()
    layout = PoolLayout.page_first(4, 2, PAGE_TOKENS, 2, 64, "float16")
    namespace = Namespace("bench-metrics", "float16", "page-first", PAGE_TOKENS, layout.page_bytes)
    key = prefix_keys(namespace, list(range(PAGE_TOKENS)))
    daemons = {}
    for name, extra in (("off", ()), ("on", ("--metrics-port", str(port))), ("off2", ())):
        (root / name).mkdir()
        daemons[name] = start_daemon(root / name, 64 << 20, 64 << 20, ("--no-disk", *extra))
    samples: dict[str, list[float]] = {"off": [], "on": [], "off2": [], "bare": []}
    try:
        for daemon in daemons.values():
            wait_ready_s(daemon)
        with contextlib.ExitStack() as stack:
            clients = {n: stack.enter_context(Client(d.socket_path, f"bench-metrics-{n}"))
                       for n, d in daemons.items()}
            pool = stack.enter_context(SharedPool(layout))
            handles = {n: pool.register(c, namespace) for n, c in clients.items()}
            for name, client in clients.items():
                if not client.store(handles[name], key, [0]).result().ok:
                    raise RuntimeError("metrics bench: store failed")
            request = pack_frame(m.encoder.encode(m.Lookup(10**6, 1, key)))
            reply_bytes = len(pack_frame(m.encoder.encode(m.LookupTiersReply(10**6, 1, ["host"]))))
            view = memoryview(bytearray(1 << 16))
            sock, _ = stack.enter_context(echo_server(root / "metrics-echo.sock", reply_bytes))
            scrapes = stack.enter_context(scraping(port, scrape_interval_s))
            calls = {n: (lambda n=n: clients[n].lookup(handles[n], key)) for n in clients}
            calls["bare"] = lambda: bare_round_trip(sock, request, reply_bytes, view)
            block = max(1, num_lookups // LOOKUP_BLOCKS)
            for call in calls.values():
                timed_calls(call, block)  # warm-up
            for _ in range(LOOKUP_BLOCKS):
                for name, call in calls.items():
                    samples[name] += timed_calls(call, block)
            num_scrapes = len(scrapes)
            scrape_latency = clients["on"].stats()["latency"].get("scrape", {})
            for name, client in clients.items():
                client.unregister_pool(handles[name])
    finally:
        for daemon in daemons.values():
            daemon.stop(STOP_TIMEOUT_S)
    off, on, off2, bare = (Latencies(samples[n]) for n in ("off", "on", "off2", "bare"))
    return {"lookup_ratio_metrics_off": off.p50_us() / bare.p50_us(),
            "lookup_ratio_metrics_on": on.p50_us() / bare.p50_us(),
            "metrics_on_off": on.p50_us() / off.p50_us(),
            "metrics_off_off": off2.p50_us() / off.p50_us(),
            "lookup_us_p50_metrics_off": off.p50_us(), "lookup_us_p99_metrics_off": off.p99_us(),
            "lookup_us_p50_metrics_on": on.p50_us(), "lookup_us_p99_metrics_on": on.p99_us(),
            "metrics_bare_rtt_us_p50": bare.p50_us(), "metrics_scrapes": num_scrapes,
            "metrics_scrape_interval_s": scrape_interval_s,
            "scrape_loop_us_p50": scrape_latency.get("p50_us", 0.0),
            "scrape_loop_us_p99": scrape_latency.get("p99_us", 0.0),
            "histogram_observe_ns": histogram_observe_ns()}


def bench_layout(client: Client, name: str, num_pages: int, repeats: int, seed: int,
                 lookups: int, root: Path, daemon_pid: int, socket_path: Path) -> dict:
    """Store / recall of one request through a pool of `2 * num_pages` pages of layout `name`."""
    layout = LAYOUTS[name](2 * num_pages, MODEL["num_layers"], PAGE_TOKENS, MODEL["num_kv_heads"],
                           MODEL["head_dim"], MODEL["dtype"])
    namespace = Namespace("bench-ipc", MODEL["dtype"], name, PAGE_TOKENS, layout.page_bytes)
    rng = np.random.default_rng(seed)
    keys = prefix_keys(namespace, rng.integers(0, 128_000, num_pages * PAGE_TOKENS))
    src_ids, dst_ids = list(range(num_pages)), list(range(num_pages, 2 * num_pages))
    total_bytes = num_pages * layout.page_bytes
    out: dict = {}
    with SharedPool(layout) as pool:
        handle = pool.register(client, namespace)
        pages = pool.pages
        page_shape = pages.shape[1:]
        np.copyto(pages[:num_pages],
                  np.frombuffer(rng.bytes(total_bytes), np.uint8).reshape(pages[:num_pages].shape))
        staging = np.empty((num_pages, layout.page_bytes), np.uint8)
        staging.fill(0)  # pre-faulted, like the daemon's arena
        rows = [staging[i].reshape(page_shape) for i in range(num_pages)]

        def copy_store() -> None:
            for i in src_ids:
                np.copyto(rows[i], pages[i])

        def copy_recall() -> None:
            for i, page in enumerate(dst_ids):
                np.copyto(pages[page], rows[i])

        def kv_store() -> None:
            result = client.store(handle, keys, src_ids).result()
            if not result.ok or result.num_done != num_pages:
                raise RuntimeError(f"store failed: {result.num_done} done, {result.failed}")

        def kv_recall() -> None:
            result = client.recall(handle, keys, dst_ids).result()
            if not result.ok or result.num_done != num_pages:
                raise RuntimeError(f"recall failed: {result.num_done} done, {result.failed}")

        steps = {"memcpy_store": copy_store, "store": kv_store,
                 "memcpy_recall": copy_recall, "recall": kv_recall}
        samples: dict[str, list[float]] = {step: [] for step in steps}
        for repetition in range(-1, repeats):
            for step, run in steps.items():
                if step == "recall" and repetition == -1:
                    pages[num_pages:] = 0  # so the verification below sees kvtier's bytes only
                gc.collect()
                start = time.perf_counter()
                run()
                elapsed = time.perf_counter() - start
                if repetition >= 0:
                    samples[step].append(elapsed)
            if repetition == -1:
                log_console.log(f"{name}: verifying recalled bytes")
                if not np.array_equal(pages[num_pages:], pages[:num_pages]):
                    raise RuntimeError(f"{name}: recalled bytes differ from the stored pages")
            if repetition < repeats - 1:
                if client.delete(handle, keys) != num_pages:
                    raise RuntimeError("delete did not find every stored key")
        # The last repetition's pages stay stored: the lookups below find them in host.
        if name == HEADLINE_LAYOUT:
            with Client(socket_path, "bench-ipc-blocking", poll_us=0) as blocking_client:
                blocking_handle = pool.register(blocking_client, namespace)
                out["latency"] = bench_lookup(client, handle, keys, lookups, root, daemon_pid,
                                              socket_path, blocking_handle, blocking_client)
                out["threaded"] = bench_threaded_lookups(
                    {"threaded_lookups": (client, handle),
                     "threaded_lookups_blocking": (blocking_client, blocking_handle)},
                    keys[:1], lookups)
                blocking_client.unregister_pool(blocking_handle)
        client.delete(handle, keys)
        client.unregister_pool(handle)
        rows = pages = None  # views of the pool: gone before it closes
    for step, values in samples.items():
        out[f"{step}_gbps"] = total_bytes / statistics.median(values) / 1e9
        out[f"{step}_ms_p50"] = float(np.percentile(values, 50)) * 1e3
        out[f"{step}_ms_p99"] = float(np.percentile(values, 99)) * 1e3
    out["store_ratio"] = out["store_gbps"] / out["memcpy_store_gbps"]
    out["recall_ratio"] = out["recall_gbps"] / out["memcpy_recall_gbps"]
    out["page_bytes"] = layout.page_bytes
    out["segment_bytes"] = layout.segment_bytes
    return out


def run(args: argparse.Namespace) -> dict:
    num_pages = args.tokens // PAGE_TOKENS
    page_bytes = PoolLayout.page_first(1, MODEL["num_layers"], PAGE_TOKENS, MODEL["num_kv_heads"],
                                       MODEL["head_dim"], MODEL["dtype"]).page_bytes
    request_bytes = num_pages * page_bytes
    host_bytes = max(512 << 20 if request_bytes <= 256 << 20 else 1 << 30,
                     -(-(request_bytes + (256 << 20)) // (256 << 20)) * (256 << 20))
    root = Path(tempfile.mkdtemp(prefix="bench-ipc-"))
    load_before = os.getloadavg()
    daemon = start_daemon(root, host_bytes, max(host_bytes, 1 << 30))
    layouts: dict[str, dict] = {}
    try:
        ready_s = wait_ready_s(daemon)
        log_console.log(f"daemon ready in {ready_s:.2f} s (host {host_bytes >> 20} MiB)")
        with Client(daemon.socket_path, "bench-ipc") as client:
            for name in (HEADLINE_LAYOUT, *[n for n in LAYOUTS if n != HEADLINE_LAYOUT]):
                log_console.log(f"{name}: {num_pages} pages x {page_bytes >> 20} MiB, "
                                f"{args.repeats} repeats")
                layouts[name] = bench_layout(client, name, num_pages, args.repeats, args.seed,
                                             args.lookups, root, daemon.pid,
                                             daemon.socket_path)
            daemon_latency = client.stats().get("latency", {})
            problems = client.check(False)
        exit_code = daemon.stop(STOP_TIMEOUT_S)
        if not args.no_metrics:
            log_console.log(f"metrics on vs off: {args.lookups} lookups each, scraped every "
                            f"{args.scrape_interval} s")
            metrics_cost = bench_metrics_cost(root, args.lookups, args.scrape_interval)
    finally:
        exit_code = daemon.stop(STOP_TIMEOUT_S)
        shutil.rmtree(root, ignore_errors=True)
    if problems:
        raise RuntimeError(f"daemon integrity check failed: {problems}")
    latency = layouts[HEADLINE_LAYOUT].pop("latency")
    threaded = layouts[HEADLINE_LAYOUT].pop("threaded")
    head = layouts[HEADLINE_LAYOUT]
    lookup, bare, request = latency["lookup"], latency["bare"], latency["request_lookup"]
    local, local16 = latency["local_lookup"], latency["local_lookup_16"]
    log_console.log("lookup plane: index upkeep per page, 10^5 pages")
    upkeep = median_figures([index_upkeep() for _ in range(INDEX_UPKEEP_RUNS)])
    results: dict = {
        "lookup_us_p50": lookup.p50_us(), "lookup_us_p99": lookup.p99_us(),
        "bare_rtt_us_p50": bare.p50_us(), "bare_rtt_us_p99": bare.p99_us(),
        "lookup_ratio": lookup.p50_us() / bare.p50_us(),
        "lookup_one_cpu_us_p50": latency["lookup_one_cpu"].p50_us(),
        "bare_rtt_one_cpu_us_p50": latency["bare_one_cpu"].p50_us(),
        "lookup_ratio_one_cpu": (latency["lookup_one_cpu"].p50_us()
                                 / latency["bare_one_cpu"].p50_us()),
        "lookup_blocking_us_p50": latency["lookup_blocking"].p50_us(),
        "lookup_blocking_one_cpu_us_p50": latency["lookup_blocking_one_cpu"].p50_us(),
        "lookup_blocking_ratio": latency["lookup_blocking"].p50_us() / bare.p50_us(),
        "poll_echo_rtt_us_p50": latency["poll_echo"].p50_us(),
        "poll_echo_rtt_one_cpu_us_p50": latency["poll_echo_one_cpu"].p50_us(),
        "lookup_vs_poll_echo": lookup.p50_us() / latency["poll_echo"].p50_us(),
        "lookup_vs_poll_echo_one_cpu": (latency["lookup_one_cpu"].p50_us()
                                        / latency["poll_echo_one_cpu"].p50_us()),
        "raw_lookup_us_p50": latency["raw_lookup"].p50_us(),
        "raw_lookup_one_cpu_us_p50": latency["raw_lookup_one_cpu"].p50_us(),
        "raw_lookup_ratio": latency["raw_lookup"].p50_us() / bare.p50_us(),
        "loop_echo_rtt_us_p50": latency["loop_echo"].p50_us(),
        "loop_echo_rtt_one_cpu_us_p50": latency["loop_echo_one_cpu"].p50_us(),
        "loop_echo_ratio": latency["loop_echo"].p50_us() / bare.p50_us(),
        "loop_echo_ratio_one_cpu": (latency["loop_echo_one_cpu"].p50_us()
                                    / latency["bare_one_cpu"].p50_us()),
        **threaded,
        "threaded_lookups_ratio": (threaded["threaded_lookups_per_s"]
                                   / threaded["threaded_lookups_blocking_per_s"]),
        "request_lookup_us_p50": request.p50_us(), "request_lookup_us_p99": request.p99_us(),
        "request_lookup_keys": num_pages,
        "local_lookup_us_p50": local.p50_us(), "local_lookup_us_p99": local.p99_us(),
        "local_lookup_16_us_p50": local16.p50_us(), "local_lookup_16_us_p99": local16.p99_us(),
        **upkeep,
        "store_gbps": head["store_gbps"], "recall_gbps": head["recall_gbps"],
        "memcpy_gbps": head["memcpy_store_gbps"],
        "memcpy_recall_gbps": head["memcpy_recall_gbps"],
        "store_ratio": head["store_ratio"], "recall_ratio": head["recall_ratio"],
        "headline_layout": HEADLINE_LAYOUT,
    }
    results["lookup_pass"] = results["lookup_ratio"] <= LOOKUP_TARGET
    results["local_lookup_pass"] = (results["local_lookup_us_p50"] <= LOCAL_LOOKUP_TARGET_US
                                    and results["local_lookup_16_us_p50"]
                                    <= LOCAL_LOOKUP_16_TARGET_US)
    results["index_upkeep_pass"] = (max(results["index_publish_us_per_page"],
                                        results["index_unpublish_us_per_page"])
                                    <= INDEX_PAGE_TARGET_US)
    if not args.no_metrics:
        results.update(metrics_cost)
    results["store_pass"] = results["store_ratio"] >= COPY_TARGET
    results["recall_pass"] = results["recall_ratio"] >= COPY_TARGET
    for name, figures in layouts.items():
        for field, value in figures.items():
            results[f"{field}_{name}"] = value
    results["targets"] = {"lookup_ratio_max": LOOKUP_TARGET, "copy_ratio_min": COPY_TARGET,
                          "local_lookup_us_max": LOCAL_LOOKUP_TARGET_US,
                          "local_lookup_16_us_max": LOCAL_LOOKUP_16_TARGET_US,
                          "index_us_per_page_max": INDEX_PAGE_TARGET_US}
    results["daemon_latency_us"] = daemon_latency  # the daemon's own per-verb view
    results["machine"] = {
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "numpy": np.__version__,
        "msgspec": msgspec.__version__, "uvloop": _has_uvloop(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "tokens": args.tokens, "num_pages": num_pages, "page_bytes": page_bytes,
        "request_bytes": request_bytes, "model": MODEL, "page_tokens": PAGE_TOKENS,
        "host_capacity_bytes": host_bytes, "repeats": args.repeats, "lookups": args.lookups,
        "seed": args.seed, "daemon_ready_s": ready_s, "daemon_exit_code": exit_code,
    }
    return results


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def print_table(results: dict) -> None:
    machine = results["machine"]
    table = Table(title=f"kvtier IPC: real daemon, {machine['tokens']}-token request "
                        f"({machine['num_pages']} x {machine['page_bytes'] >> 20} MiB pages), "
                        f"median of {machine['repeats']}, {machine['cpu_count']} CPUs",
                  caption="GB/s of the median repetition; store/recall p99 in ms per request")
    for column in ("measurement", "kvtier p50", "p99", "baseline", "base p50", "p99 ", "ratio",
                   "target", ""):
        table.add_column(column,
                         justify="left" if column in ("measurement", "baseline") else "right")

    def verdict(ok: bool) -> str:
        return "[green]pass" if ok else "[red]FAIL"

    r = results
    table.add_row("lookup 1 key us", f"{r['lookup_us_p50']:.1f}", f"{r['lookup_us_p99']:.1f}",
                  "socket echo", f"{r['bare_rtt_us_p50']:.1f}",
                  f"{r['bare_rtt_us_p99']:.1f}", f"{r['lookup_ratio']:.2f}",
                  f"<= {LOOKUP_TARGET:g}", verdict(r["lookup_pass"]))
    table.add_row("lookup 1 key us, one CPU", f"{r['lookup_one_cpu_us_p50']:.1f}", "",
                  "socket echo", f"{r['bare_rtt_one_cpu_us_p50']:.1f}", "",
                  f"{r['lookup_ratio_one_cpu']:.2f}", "", "")
    for suffix, where in (("", ""), ("_one_cpu", ", one CPU")):
        bare_us = r[f"bare_rtt{suffix}_us_p50"]
        for label, figure in (("lookup, reply not polled", f"lookup_blocking{suffix}_us_p50"),
                              ("echo, reply polled", f"poll_echo_rtt{suffix}_us_p50"),
                              ("event-loop echo", f"loop_echo_rtt{suffix}_us_p50"),
                              ("raw lookup frame", f"raw_lookup{suffix}_us_p50")):
            table.add_row(f"{label} us{where}", f"{r[figure]:.1f}", "", "socket echo",
                          f"{bare_us:.1f}", "", f"{r[figure] / bare_us:.2f}", "", "")
    table.add_row(f"lookups/s, {LOOKUP_THREADS} threads, 1 client",
                  f"{r['threaded_lookups_per_s']:.0f}", "", "client not polling",
                  f"{r['threaded_lookups_blocking_per_s']:.0f}", "",
                  f"{r['threaded_lookups_ratio']:.2f}", "", "")
    table.add_row(f"lookup {r['request_lookup_keys']} keys us",
                  f"{r['request_lookup_us_p50']:.1f}", f"{r['request_lookup_us_p99']:.1f}",
                  "socket echo", f"{r['bare_rtt_us_p50']:.1f}",
                  f"{r['bare_rtt_us_p99']:.1f}",
                  f"{r['request_lookup_us_p50'] / r['bare_rtt_us_p50']:.2f}", "", "")
    table.add_row(f"local lookup {r['request_lookup_keys']} keys us",
                  f"{r['local_lookup_us_p50']:.1f}", f"{r['local_lookup_us_p99']:.1f}",
                  "socket lookup", f"{r['request_lookup_us_p50']:.1f}",
                  f"{r['request_lookup_us_p99']:.1f}",
                  f"{r['local_lookup_us_p50'] / r['request_lookup_us_p50']:.2f}",
                  f"<= {LOCAL_LOOKUP_TARGET_US:g} us", verdict(r["local_lookup_pass"]))
    table.add_row("local lookup 16 keys us", f"{r['local_lookup_16_us_p50']:.1f}",
                  f"{r['local_lookup_16_us_p99']:.1f}", "", "", "", "",
                  f"<= {LOCAL_LOOKUP_16_TARGET_US:g} us",
                  verdict(r["local_lookup_16_us_p50"] <= LOCAL_LOOKUP_16_TARGET_US))
    table.add_row("index upkeep us/page", f"{r['index_publish_us_per_page']:.2f} in",
                  f"{r['index_unpublish_us_per_page']:.2f} out", "", "", "",
                  f"{r['index_bytes_per_page']:.1f} B/page, stall "
                  f"{r['index_stall_ms']:.0f} ms",
                  f"<= {INDEX_PAGE_TARGET_US:g} us", verdict(r["index_upkeep_pass"]))
    table.add_row(f"full index lookup us ({r['index_fill']:.0%} full)",
                  f"{r['full_table_lookup_us_p50']:.1f}", "", "", "", "",
                  f"16 keys: {r['full_table_lookup_16_us_p50']:.1f}",
                  f"<= {LOCAL_LOOKUP_TARGET_US:g} us",
                  verdict(r["full_table_lookup_us_p50"] <= LOCAL_LOOKUP_TARGET_US))
    for name in LAYOUTS:
        for verb in ("store", "recall"):
            ratio = r[f"{verb}_ratio_{name}"]
            headline = " *" if name == HEADLINE_LAYOUT else ""
            table.add_row(f"{verb} {name} GB/s{headline}", f"{r[f'{verb}_gbps_{name}']:.2f}",
                          f"{r[f'{verb}_ms_p99_{name}']:.0f} ms", "np.copyto",
                          f"{r[f'memcpy_{verb}_gbps_{name}']:.2f}",
                          f"{r[f'memcpy_{verb}_ms_p99_{name}']:.0f} ms", f"{ratio:.2f}",
                          f">= {COPY_TARGET:g}", verdict(ratio >= COPY_TARGET))
    console = Console(width=max(Console().width, 110))
    console.print(table)
    load = machine["loadavg_before"][0], machine["loadavg_after"][0]
    console.print(f"* headline layout. p99 of store/recall is over {machine['repeats']} "
                  f"repetitions of the whole request. load average before/after: "
                  f"{load[0]:.2f} / {load[1]:.2f}")
    if "metrics_on_off" in r:
        console.print(f"metrics off: lookup_ratio {r['lookup_ratio_metrics_off']:.2f} "
                      f"(p50 {r['lookup_us_p50_metrics_off']:.1f} us, p99 "
                      f"{r['lookup_us_p99_metrics_off']:.1f} us); metrics on, scraped every "
                      f"{r['metrics_scrape_interval_s']:g} s ({r['metrics_scrapes']} scrapes): "
                      f"lookup_ratio {r['lookup_ratio_metrics_on']:.2f} (p50 "
                      f"{r['lookup_us_p50_metrics_on']:.1f} us, p99 "
                      f"{r['lookup_us_p99_metrics_on']:.1f} us); "
                      f"on / off {r['metrics_on_off']:.3f} "
                      f"(noise, off / off: {r['metrics_off_off']:.3f}); "
                      f"bare echo p50 {r['metrics_bare_rtt_us_p50']:.1f} us; a scrape holds the "
                      f"daemon's loop p50 {r['scrape_loop_us_p50']:.0f} us, p99 "
                      f"{r['scrape_loop_us_p99']:.0f} us")
        console.print(f"histogram observe per request: {r['histogram_observe_ns']:.0f} ns "
                      f"({r['histogram_observe_ns'] / 1e3 / r['lookup_us_p50']:.2%} of a lookup "
                      f"round trip)")
    for verb, data in sorted(r["daemon_latency_us"].items()):
        console.print(f"daemon-side {verb}: p50 {data['p50_us']:.1f} us, "
                      f"p99 {data['p99_us']:.1f} us over {data['count']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--repeats", type=int, default=7, help="timed store/recall repetitions")
    parser.add_argument("--lookups", type=int, default=5000, help="timed one-key lookups")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scrape-interval", type=float, default=0.1, metavar="SECONDS",
                        help="how often the metrics-on daemon is scraped: far more often than "
                             "Prometheus (every 15-60 s), so scrapes fall inside the timing")
    parser.add_argument("--no-metrics", action="store_true",
                        help="skip the metrics on vs off lookup comparison")
    parser.add_argument("--quick", action="store_true",
                        help="1024 tokens, 3 repeats, 1000 lookups: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.lookups = 1024, 3, 1000
    if args.tokens < PAGE_TOKENS or args.repeats < 1 or args.lookups < LOOKUP_BLOCKS:
        parser.error(f"--tokens must be >= {PAGE_TOKENS}, --repeats >= 1, "
                     f"--lookups >= {LOOKUP_BLOCKS}")
    return args


def main() -> None:
    args = parse_args()
    results = run(args)
    if args.json:
        print(json.dumps(results))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
