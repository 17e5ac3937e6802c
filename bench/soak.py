"""Reliability soak of a real kvtier daemon under faults, load and bad input.

Run:

    python bench/soak.py [--quick] [--json] [--seed 0]

Every phase starts its own `kvtier serve` child (socket and disk directory under a fresh
directory in /tmp, removed at the end; daemons stopped, mounts unmounted, whatever happens).
Page contents are a deterministic function of the key (a PCG64 stream seeded by it), so every
recall is checked byte for byte against what was stored under that key, not only by checksum.

- kill: a writer thread stores pages (write-through: acknowledged = durable; 1 MiB host, so most
  pages live only on disk); once a random number of stores was acknowledged the daemon gets
  SIGKILL at a random moment, restarts on the same disk directory and socket, and is checked:
  `check()` clean, every acknowledged key found and recalled byte-identical, every key ever
  attempted either missing or byte-identical. 20 cycles (--quick: 20 shorter ones).
- client_kill: a client subprocess registers a pool, stores and pins pages, starts a big store
  and/or recall and is SIGKILLed while they are in flight. The daemon's fds (/proc/<pid>/fd) and
  held pool segments (open in /proc/<pid>/fd or mapped) return to what they were, its leases end, and a
  second client's pages and lease are untouched.
- load: 16 client processes for a bounded time doing lookup / store / recall / delete on
  overlapping keys (each stores and deletes only its own keys, lookups and recalls cross over),
  write-through with a disk tier large enough that nothing is dropped; lost = an acknowledged,
  never deleted key not served. Daemon RSS is sampled against host capacity + a stated overhead.
- corruption: bytes of `pages.slots` flipped while the daemon runs and while it is stopped: the
  page must be reported (failed recall, `check(verify_bytes=True)`) and then be a miss.
- fuzz: >= 100,000 frames (valid requests, bad values, random msgpack, random bytes, truncated
  frames, oversized length prefixes) over several connections; the daemon must keep its pid
  and answer.
- remote: two daemons (1 MiB host each) share a loopback redis-server (tests/tiers/remote's starter);
  node a stores rounds of pages (written through to Redis), node b recalls pages it never held,
  while Redis is killed and restarted between rounds (2, --quick; 6) and bytes of 3 values a
  round are flipped in Redis: node b must serve no wrong or corrupt page, count every corrupt
  value as an integrity error, see every outage and reconnect. Skipped without redis-server.
- full_disk: a small --disk-capacity (stores evict: it is a cache) and, as root, an 8 MiB tmpfs
  under a larger --disk-capacity: stores fail naming a full file system, earlier pages stay
  byte-identical, the daemon keeps serving (skipped with a note if mounting fails).

Must be zero: wrong_pages, lost_pages, corrupt_served, leaked_segments, leaked_fds,
daemon_restarts_needed. `ops`, `p50_us`, `p99_us` are the load phase's. `--json` prints exactly
one JSON object on stdout; progress goes to stderr. --quick finishes in under 45 s on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import msgspec
import numpy as np
import psutil

from kvtier.client import Client, DaemonReplyError, PoolHandle, SharedPool
from kvtier.config import RemoteConfig
from kvtier.ipc import messages as m
from kvtier.ipc.frames import DEFAULT_MAX_FRAME_BYTES, HEADER_BYTES, pack_frame, recv_frame
from kvtier.keys import Namespace
from kvtier.daemon.child_process import DaemonProcess
from kvtier.pools import PoolLayout
from kvtier.tiers.disk import DISK_ALIGNMENT
from kvtier.tiers.page_format import HEADER, HEADER_BYTES as PAGE_HEADER_BYTES, MAGIC
from kvtier.tiers.remote import redis_key

# 16 tokens x 2 heads x 64 dims x 2 bytes = 4 KiB per K or V segment; x 2 layers x 2 = 16 KiB.
LAYOUT = PoolLayout.page_first(64, 2, 16, 2, 64, "float16")
PAGE_BYTES = LAYOUT.page_bytes
NAMESPACE = Namespace("soak", "float16", "page-first", 16, PAGE_BYTES)
DISK_SLOT_BYTES = 20 << 10  # a 16 KiB page plus its 64-byte header, in 4 KiB blocks
# What the daemon may hold beyond its host capacity: the interpreter and libraries (~80 MiB
# measured), one 8 MiB disk staging buffer per copy thread and the writer (40 MiB), the client
# pools it maps (16 x 1 MiB in the load phase) and allocator slack.
RSS_OVERHEAD_BYTES = 192 << 20
MUST_BE_ZERO = ("wrong_pages", "lost_pages", "corrupt_served", "leaked_segments", "leaked_fds",
                "daemon_restarts_needed")
Figures = dict[str, object]


def progress(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def key_of(*parts: object) -> bytes:
    """A 16-byte key naming one page of the soak."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def page_content(key: bytes) -> np.ndarray:
    """The bytes every page stored under `key` holds: a PCG64 stream seeded by the key."""
    generator = np.random.Generator(np.random.PCG64(int.from_bytes(key, "little")))
    return np.frombuffer(generator.bytes(PAGE_BYTES), np.uint8)


def chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def serve_args(disk_path: Path, host: str, disk: str, *extra: str) -> tuple[str, ...]:
    return ("--host-capacity", host, "--disk-path", str(disk_path), "--disk-capacity", disk,
            "--no-prefault", *extra)


class Pager:
    """A client with a 64-page pool: stores pages of keys, recalls and verifies them."""

    def __init__(self, socket_path: Path, name: str, namespace: Namespace = NAMESPACE,
                 layout: PoolLayout = LAYOUT) -> None:
        self.client = Client(socket_path, client_name=name)
        self.pool = SharedPool(layout)
        self.handle: PoolHandle = self.pool.register(self.client, namespace)
        self.num_pages = layout.num_pages

    def store(self, keys: Sequence[bytes]) -> dict[bytes, str]:
        """Store `keys` (at most one pool's worth); returns the failed ones with their reasons."""
        for page_id, key in enumerate(keys):
            self.pool.pages[page_id] = page_content(key).reshape(self.pool.pages.shape[1:])
        return self.client.store(self.handle, keys, range(len(keys))).result().failed

    def recall(self, keys: Sequence[bytes]) -> tuple[set[bytes], int, dict[bytes, str]]:
        """Recall `keys` in pool-sized batches: (keys served, how many differed, failed keys)."""
        served: set[bytes] = set()
        failed: dict[bytes, str] = {}
        num_wrong = 0
        for batch in chunks(list(keys), self.num_pages):
            self.pool.pages[: len(batch)] = 0xEE  # poison: a page reported served must be written
            result = self.client.recall(self.handle, batch, range(len(batch))).result()
            failed.update(result.failed)
            absent = set(result.missing) | set(result.failed)
            for page_id, key in enumerate(batch):
                if key in absent:
                    continue
                served.add(key)
                num_wrong += not np.array_equal(self.pool.pages[page_id].reshape(-1),
                                                page_content(key))
        return served, num_wrong, failed

    def lookup_missing(self, keys: Sequence[bytes]) -> set[bytes]:
        missing: set[bytes] = set()
        for batch in chunks(list(keys), 4096):
            tiers = self.client.lookup(self.handle, batch).tiers
            missing.update(k for k, tier in zip(batch, tiers) if tier is None)
        return missing

    def close(self) -> None:
        self.client.close()
        self.pool.close()


@contextmanager
def running_daemon(socket_path: Path, *args: str) -> Iterator[DaemonProcess]:
    """A daemon that is stopped (or killed, if it will not stop) however the block ends."""
    daemon = DaemonProcess.start(socket_path, *args)
    try:
        yield daemon
    finally:
        if daemon.running:
            try:
                daemon.stop(30)
            finally:
                if daemon.running:
                    daemon.kill()


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def daemon_pool_segments(pid: int) -> set[str]:
    """Client pool segments the daemon holds now: open (how it copies them) or mapped."""
    held = Path(f"/proc/{pid}/maps").read_text()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += "\n" + os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
    return set(re.findall(r"/dev/shm/(kvtier-pool-\d+-[0-9a-f]+)", held))


def shm_files(prefix: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Repeat `predicate` (daemon round trips, /proc reads) until it holds or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
    return True


class Writer(threading.Thread):
    """Stores batches of fresh pages until its daemon dies; records what was acknowledged."""

    def __init__(self, socket_path: Path, cycle: int, batch_pages: int) -> None:
        super().__init__(daemon=True)
        self.socket_path = socket_path
        self.cycle = cycle
        self.batch_pages = batch_pages
        self.attempted: list[bytes] = []
        self.acked: list[bytes] = []
        self.failures: dict[bytes, str] = {}
        self.changed = threading.Condition()
        self.ended = False

    def run(self) -> None:
        pager = None
        try:
            pager = Pager(self.socket_path, f"writer-{self.cycle}")
            for batch_index in range(1 << 30):
                keys = [key_of("kill", self.cycle, batch_index, i) for i in range(self.batch_pages)]
                self.attempted += keys
                failed = pager.store(keys)
                with self.changed:
                    self.acked += [k for k in keys if k not in failed]
                    self.failures.update(failed)
                    self.changed.notify_all()
        except (ConnectionError, OSError, TimeoutError, DaemonReplyError):
            pass  # the daemon was killed under us
        finally:
            if pager is not None:
                pager.close()
            with self.changed:
                self.ended = True
                self.changed.notify_all()


def phase_kill(work: Path, num_cycles: int, max_acks: int, rng: random.Random) -> Figures:
    """SIGKILL the daemon during sustained write-through stores; check each restart."""
    socket_path, disk_path = work / "kill.sock", work / "kill-disk"
    args = serve_args(disk_path, "1MiB", "256MiB", "--write-policy", "write-through")
    acked: set[bytes] = set()
    attempted: list[bytes] = []
    figures = {"cycles": num_cycles, "acked_pages": 0, "attempted_pages": 0, "lost_pages": 0,
               "wrong_pages": 0, "check_problems": 0, "verify_problems_unacked": 0,
               "verify_problems_acked": 0, "unacked_present": 0, "store_failures": 0,
               "restart_s_max": 0.0, "leaked_segments": 0}
    killed_pids: list[int] = []
    daemon = DaemonProcess.start(socket_path, *args)
    try:
        for cycle in range(num_cycles):
            writer = Writer(socket_path, cycle, batch_pages=rng.choice((1, 4, 8, 16)))
            writer.start()
            target = rng.randint(4, max_acks)
            with writer.changed:
                writer.changed.wait_for(lambda: len(writer.acked) >= target or writer.ended, 60)
            time.sleep(rng.uniform(0, 0.004))  # a random moment, not a synchronization
            killed_pids.append(daemon.pid)
            daemon.kill()
            writer.join(60)
            acked.update(writer.acked)
            attempted += writer.attempted
            figures["store_failures"] += len(writer.failures)
            started = time.monotonic()
            daemon = DaemonProcess.start(socket_path, *args)
            figures["restart_s_max"] = max(figures["restart_s_max"], time.monotonic() - started)
            pager = Pager(socket_path, "verifier")
            try:
                figures["check_problems"] += len(pager.client.check())
                for problem in pager.client.check(verify_bytes=True):
                    scoped = re.search(r"page ([0-9a-f]{64})", problem)
                    acked_key = scoped is not None and bytes.fromhex(scoped[1])[16:] in acked
                    kind = "acked" if acked_key else "unacked"
                    figures[f"verify_problems_{kind}"] += 1
                served, num_wrong, _ = pager.recall(attempted)
                missing = pager.lookup_missing(sorted(acked))
                figures["lost_pages"] += len(missing | (acked - served))
                figures["wrong_pages"] += num_wrong
                figures["unacked_present"] = len(served - acked)
            finally:
                pager.close()
        figures["final_exit_code"] = daemon.stop(30)
    finally:
        if daemon.running:
            daemon.kill()
    figures["acked_pages"] = len(acked)
    figures["attempted_pages"] = len(attempted)
    figures["leaked_segments"] = sum(len(shm_files(f"kvtier-host-{pid}-")) for pid in killed_pids)
    return figures


VICTIM_PAGES = 256


def run_victim(socket_path: str, mode: str) -> None:
    """The client that gets killed: a pool, pinned pages, then big stores / recalls in flight."""
    layout = PoolLayout.page_first(VICTIM_PAGES, 2, 16, 2, 64, "float16")
    pager = Pager(Path(socket_path), f"victim-{mode}", layout=layout)
    keys = [key_of("victim", os.getpid(), i) for i in range(VICTIM_PAGES)]
    assert not pager.store(keys[:64])
    pager.client.pin(pager.handle, keys[:64], 3600.0)
    if mode in ("store", "both"):
        for page_id, key in enumerate(keys):
            pager.pool.pages[page_id] = page_content(key).reshape(pager.pool.pages.shape[1:])
        pager.client.store(pager.handle, keys, range(VICTIM_PAGES))
    if mode in ("recall", "both"):
        for _ in range(4):
            pager.client.recall(pager.handle, keys[:64], range(64, 128))
    print("in flight", flush=True)
    sys.stdin.read()  # killed here


def phase_client_kill(work: Path, num_kills: int, rng: random.Random) -> Figures:
    """SIGKILL clients with stores and recalls in flight; nothing of theirs may stay behind."""
    socket_path = work / "ck.sock"
    figures: Figures = {"clients_killed": 0, "leaked_fds": 0, "leaked_segments": 0,
                        "daemon_mapped_segments_left": 0, "killed_client_shm_files_left": 0,
                        "leases_left": 0, "sessions_left": 0, "survivor_wrong_pages": 0,
                        "survivor_lost_pages": 0}
    with running_daemon(socket_path, *serve_args(work / "ck-disk", "16MiB", "64MiB")) as daemon:
        survivor = Pager(socket_path, "survivor")
        try:
            survivor_keys = [key_of("survivor", i) for i in range(32)]
            assert not survivor.store(survivor_keys)
            survivor.client.pin(survivor.handle, survivor_keys, 3600.0)

            def state() -> tuple[int, frozenset[str], int, int]:
                stats = survivor.client.stats()
                return (daemon_fds(daemon.pid), frozenset(daemon_pool_segments(daemon.pid)),
                        stats["num_leases"], len(stats["clients"]))

            baseline = state()
            for kill in range(num_kills):
                mode = ("store", "recall", "both")[kill % 3]
                victim = subprocess.Popen(
                    [sys.executable, __file__, "--victim", str(socket_path), mode],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                line = victim.stdout.readline()
                time.sleep(rng.uniform(0, 0.003))  # a random moment inside the copies
                victim.kill()
                victim.wait()
                victim.stdin.close()
                victim.stdout.close()
                if line.strip() != "in flight":
                    raise RuntimeError(f"victim client failed before its requests ({mode})")
                figures["clients_killed"] += 1
                wait_until(lambda: state() == baseline, 15.0)
                fds, segments, leases, sessions = state()
                figures["leaked_fds"] += max(0, fds - baseline[0])
                figures["daemon_mapped_segments_left"] += len(segments - baseline[1])
                figures["leases_left"] += max(0, leases - baseline[2])
                figures["sessions_left"] += max(0, sessions - baseline[3])
                # A SIGKILLed client cannot unlink its pool: the daemon's housekeeping does,
                # within a second or two of the client's death.
                wait_until(lambda: not shm_files(f"kvtier-pool-{victim.pid}-"), 10.0)
                left = shm_files(f"kvtier-pool-{victim.pid}-")
                figures["killed_client_shm_files_left"] += len(left)
                for name in left:  # so that repeated runs do not pile them up
                    Path("/dev/shm", name).unlink(missing_ok=True)
                served, num_wrong, _ = survivor.recall(survivor_keys)
                figures["survivor_wrong_pages"] += num_wrong
                figures["survivor_lost_pages"] += len(set(survivor_keys) - served)
            figures["check_problems"] = len(survivor.client.check())
        finally:
            survivor.close()
        host_arenas = len(shm_files(f"kvtier-host-{daemon.pid}-"))
    figures["leaked_segments"] = (figures["daemon_mapped_segments_left"]
                                  + figures["killed_client_shm_files_left"] + (host_arenas != 1))
    return figures


LOAD_KEYS_PER_WORKER = 128
LOAD_BATCH = 4
LOAD_OPS = ("lookup", "store", "recall", "delete")
LOAD_WEIGHTS = (4, 2, 3, 1)


def load_worker(worker: int, num_workers: int, socket_path: str, duration_s: float, seed: int,
                ready: multiprocessing.Queue, go: multiprocessing.Event,
                results: multiprocessing.Queue) -> None:
    """One load client: mixed verbs for `duration_s`; puts its figures on `results`."""
    rng = random.Random(seed * 1000 + worker)
    figures = {"worker": worker, "wrong": 0, "lost": 0, "store_failures": 0, "error": ""}
    latencies: dict[str, list[float]] = {op: [] for op in LOAD_OPS}
    alive: set[bytes] = set()
    own = [key_of("load", worker, i) for i in range(LOAD_KEYS_PER_WORKER)]
    everyone = [key_of("load", w, i) for w in range(num_workers)
                for i in range(LOAD_KEYS_PER_WORKER)]
    pager = Pager(Path(socket_path), f"load-{worker}")
    ready.put(worker)
    go.wait()
    deadline = time.monotonic() + duration_s
    try:
        while time.monotonic() < deadline:
            op = rng.choices(LOAD_OPS, LOAD_WEIGHTS)[0]
            mine = rng.sample(own, LOAD_BATCH)
            keys = mine if op in ("store", "delete") else rng.sample(everyone + own, LOAD_BATCH)
            started = time.perf_counter()
            if op == "lookup":
                missing = pager.lookup_missing(keys)
            elif op == "store":
                failed = pager.store(keys)
            elif op == "recall":
                served, num_wrong, _ = pager.recall(keys)
            else:
                pager.client.delete(pager.handle, keys)
            latencies[op].append((time.perf_counter() - started) * 1e6)
            if op == "lookup":
                figures["lost"] += len(missing & alive)
            elif op == "store":
                figures["store_failures"] += len(failed)
                alive.update(k for k in keys if k not in failed)
            elif op == "recall":
                figures["wrong"] += num_wrong
                figures["lost"] += len((set(keys) & alive) - served)
            else:
                alive.difference_update(keys)
    except Exception as exc:  # reported, and counted by the parent as a failed worker
        figures["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        pager.close()
    figures["alive"] = sorted(alive)
    figures["latencies"] = {op: np.asarray(v, np.float32) for op, v in latencies.items()}
    results.put(figures)


class RssSampler(threading.Thread):
    """The daemon's peak resident set, sampled every 20 ms until `stop`."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak_bytes = self.process.memory_info().rss
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak_bytes


def phase_load(work: Path, num_workers: int, duration_s: float, seed: int) -> Figures:
    """Many client processes, mixed verbs on overlapping keys, every recall verified."""
    socket_path = work / "load.sock"
    host_bytes = 8 << 20
    args = serve_args(work / "load-disk", "8MiB", "96MiB", "--write-policy", "write-through")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["kvtier.client", "numpy"])
    with running_daemon(socket_path, *args) as daemon:
        ready, results, go = context.Queue(), context.Queue(), context.Event()
        workers = [context.Process(target=load_worker, args=(
            w, num_workers, str(socket_path), duration_s, seed, ready, go, results))
            for w in range(num_workers)]
        for process in workers:
            process.start()
        for _ in workers:
            ready.get(timeout=120)
        sampler = RssSampler(daemon.pid)
        baseline_rss = sampler.peak_bytes
        sampler.start()
        started = time.monotonic()
        go.set()
        outcomes = [results.get(timeout=duration_s + 120) for _ in workers]
        elapsed_s = time.monotonic() - started
        for process in workers:
            process.join(30)
        peak_rss = sampler.stop()
        latencies = {op: np.concatenate([o["latencies"][op] for o in outcomes]) for op in LOAD_OPS}
        everything = np.concatenate(list(latencies.values()))
        alive = [key for o in outcomes for key in o["alive"]]
        verifier = Pager(socket_path, "load-verifier")
        try:
            served, final_wrong, _ = verifier.recall(alive)
            problems = verifier.client.check()
        finally:
            verifier.close()
    figures: Figures = {
        "clients": num_workers, "duration_s": round(elapsed_s, 2), "ops": int(everything.size),
        "ops_per_s": round(everything.size / elapsed_s),
        "p50_us": round(float(np.percentile(everything, 50)), 1),
        "p99_us": round(float(np.percentile(everything, 99)), 1),
        "wrong_pages": sum(o["wrong"] for o in outcomes) + final_wrong,
        "lost_pages": sum(o["lost"] for o in outcomes) + len(set(alive) - served),
        "store_failures": sum(o["store_failures"] for o in outcomes),
        "worker_errors": [o["error"] for o in outcomes if o["error"]],
        "final_alive_pages": len(alive), "check_problems": len(problems),
        "check_problem_examples": problems[:3],
        "rss_baseline_mib": baseline_rss >> 20, "rss_peak_mib": peak_rss >> 20,
        "rss_bound_mib": (host_bytes + RSS_OVERHEAD_BYTES) >> 20,
        "rss_over_bound_mib": max(0, (peak_rss - host_bytes - RSS_OVERHEAD_BYTES) >> 20),
    }
    for op, values in latencies.items():
        figures[f"{op}_ops"] = int(values.size)
        if values.size:
            figures[f"{op}_p50_us"] = round(float(np.percentile(values, 50)), 1)
            figures[f"{op}_p99_us"] = round(float(np.percentile(values, 99)), 1)
    return figures


def slot_offsets(slot_file: Path) -> dict[bytes, int]:
    """{key: offset of its slot} from the page headers in a slot file (slots start at 64 bytes)."""
    data = slot_file.read_bytes()
    offsets = {}
    for match in re.finditer(re.escape(MAGIC), data):
        offset = match.start()
        if offset % DISK_ALIGNMENT == 0:
            fields = HEADER.unpack_from(data, offset)
            offsets[fields[5]] = offset
    return offsets


def flip_bytes(slot_file: Path, offset: int, rng: random.Random, in_header: bool) -> None:
    """Invert one byte of a page's header or payload in place."""
    if in_header:
        position = offset + rng.choice((0, 20, 36, 56))  # magic, fingerprint, key, checksum
    else:
        position = offset + PAGE_HEADER_BYTES + rng.randrange(PAGE_BYTES)
    with open(slot_file, "r+b") as file:
        file.seek(position)
        byte = file.read(1)
        file.seek(position)
        file.write(bytes([byte[0] ^ 0xFF]))
        file.flush()
        os.fsync(file.fileno())


def phase_corruption(work: Path, num_flips: int, rng: random.Random) -> Figures:
    """Flip bytes of disk pages while the daemon runs and while it is stopped."""
    socket_path, disk_path = work / "cr.sock", work / "cr-disk"
    slot_file = disk_path / "pages.slots"
    args = serve_args(disk_path, "1MiB", "16MiB", "--write-policy", "write-through")
    keys = [key_of("corrupt", i) for i in range(256)]
    figures: Figures = {"flipped_running": 0, "flipped_stopped": 0, "corrupt_served": 0,
                        "corrupt_reported": 0, "corrupt_listed_after": 0,
                        "reported_by_check": 0, "check_after_problems": 0, "wrong_pages": 0,
                        "lost_pages": 0}
    with running_daemon(socket_path, *args) as daemon:
        pager = Pager(socket_path, "corrupt")
        try:
            for batch in chunks(keys, 64):
                assert not pager.store(batch)
            tiers = pager.client.lookup(pager.handle, keys).tiers
            disk_only = [k for k, tier in zip(keys, tiers) if tier == "disk"]
            offsets = slot_offsets(slot_file)
            victims = rng.sample(disk_only, num_flips)
            for index, key in enumerate(victims):
                flip_bytes(slot_file, offsets[key], rng, in_header=index % 4 == 0)
            figures["flipped_running"] = len(victims)
            figures.update(_judge_corrupt(pager, victims))
        finally:
            pager.close()
        daemon.stop(30)
    kept = [k for k in keys if k not in set(victims)]
    offsets = slot_offsets(slot_file)
    stopped_victims = rng.sample(kept, num_flips)
    for index, key in enumerate(stopped_victims):
        flip_bytes(slot_file, offsets[key], rng, in_header=index % 4 == 1)
    figures["flipped_stopped"] = len(stopped_victims)
    with running_daemon(socket_path, *args) as daemon:
        pager = Pager(socket_path, "corrupt")
        try:
            figures["check_problems"] = len(pager.client.check())
            problems = pager.client.check(verify_bytes=True)
            figures["reported_by_check"] = sum(
                any(key.hex() in problem for problem in problems) for key in stopped_victims)
            stopped = _judge_corrupt(pager, stopped_victims)
            for name, value in stopped.items():
                figures[name] += value
            sound = [k for k in kept if k not in set(stopped_victims)]
            served, num_wrong, _ = pager.recall(sound)
            figures["wrong_pages"] = num_wrong
            figures["lost_pages"] = len(set(sound) - served)
            figures["check_after_problems"] = len(pager.client.check(verify_bytes=True))
        finally:
            pager.close()
    return figures


def _judge_corrupt(pager: Pager, victims: list[bytes]) -> Figures:
    """Recall corrupted pages: each must be reported failed, never served, then be a miss."""
    served, num_wrong, failed = pager.recall(victims)
    return {"corrupt_served": len(served), "corrupt_reported": len(set(failed) & set(victims)),
            "corrupt_listed_after": len(set(victims) - pager.lookup_missing(victims)),
            "wrong_pages": num_wrong}


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
            SharedPool(LAYOUT) as pool:
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
                    tail = pack_frame(cut)[: rng.randrange(1, HEADER_BYTES + len(cut))]
                elif ending == "oversized":
                    tail = rng.choice((DEFAULT_MAX_FRAME_BYTES + 1, 2**31, 2**32 - 1)).to_bytes(
                        HEADER_BYTES, "big")
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


def phase_full_disk(work: Path) -> Figures:
    """A small disk cap (evicts, like a cache) and a file system that really fills."""
    figures: Figures = {}
    socket_path = work / "fd.sock"
    keys = [key_of("smallcap", i) for i in range(512)]
    args = serve_args(work / "fd-disk", "1MiB", "2MiB", "--write-policy", "write-through")
    with running_daemon(socket_path, *args):
        pager = Pager(socket_path, "small-cap")
        try:
            failures = sum(len(pager.store(batch)) for batch in chunks(keys, 32))
            served, num_wrong, _ = pager.recall(keys)
            stats = pager.client.stats()
            disk = next(t for t in stats["tiers"] if t["tier"] == "disk")
            figures.update(small_cap_store_failures=failures, small_cap_pages_held=len(served),
                           small_cap_evictions=disk["evictions"], wrong_pages=num_wrong,
                           small_cap_check_problems=len(pager.client.check()))
        finally:
            pager.close()
    figures.update(_really_full_disk(work))
    figures["wrong_pages"] += figures.pop("full_fs_wrong_pages", 0)
    return figures


def _really_full_disk(work: Path) -> Figures:
    if os.geteuid() != 0:
        return {"full_fs": "skipped: mounting a tmpfs needs root"}
    mount_point = work / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        return {"full_fs": f"skipped: mount failed ({mounted.stderr.strip()})"}
    figures: Figures = {"full_fs": "8 MiB tmpfs, --disk-capacity 64MiB"}
    try:
        config = work / "full.toml"
        config.write_text('[disk]\nchunk = "1MiB"\n')  # grow the slot file 1 MiB at a time
        socket_path = work / "full.sock"
        args = ("--config", str(config),
                *serve_args(mount_point / "disk", "1MiB", "64MiB", "--write-policy",
                            "write-through"))
        with running_daemon(socket_path, *args) as daemon:
            pager = Pager(socket_path, "full-fs")
            try:
                acked: list[bytes] = []
                reasons: list[str] = []
                for batch_index in range(64):
                    keys = [key_of("fullfs", batch_index, i) for i in range(16)]
                    failed = pager.store(keys)
                    acked += [k for k in keys if k not in failed]
                    reasons += list(failed.values())
                    if len(reasons) >= 48:
                        break
                served, num_wrong, _ = pager.recall(acked)
                pager.client.ping()
                clear = [r for r in reasons if "full" in r]
                figures.update(
                    full_fs_acked_pages=len(acked), full_fs_failed_pages=len(reasons),
                    full_fs_clear_errors=len(clear),
                    full_fs_error_example=(reasons[0] if reasons else "none: nothing failed"),
                    full_fs_lost_pages=len(set(acked) - served), full_fs_wrong_pages=num_wrong,
                    full_fs_check_problems=len(pager.client.check()),
                    full_fs_daemon_serving=daemon.running)
            finally:
                pager.close()
    finally:
        unmounted = subprocess.run(["umount", str(mount_point)], capture_output=True, text=True)
        if unmounted.returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)
    return figures


def phase_remote(work: Path, num_outages: int, num_flips: int, rng: random.Random) -> Figures:
    """Two daemons share a Redis; node a stores, node b recalls what it never held, while Redis
    is killed and restarted and some of its values are corrupted."""
    from kvtier.testing import redis as redis_servers

    if redis_servers.REDIS_SERVER is None:
        return {"remote": "skipped: redis-server is not installed"}
    import redis as redis_py

    server = redis_servers.RedisServer(work / "redis")
    server.start()
    figures: Figures = {"outages_caused": 0, "corrupted_values": 0, "corrupt_served": 0,
                        "wrong_pages": 0, "remote_served": 0}
    remote = ("--remote-url", server.url)
    try:
        with running_daemon(work / "ra.sock", *serve_args(work / "ra-disk", "1MiB", "64MiB",
                                                          *remote)) as node_a, \
                running_daemon(work / "rb.sock", *serve_args(work / "rb-disk", "1MiB", "64MiB",
                                                             *remote)) as node_b:
            writer, reader = Pager(node_a.socket_path, "remote-a"), Pager(node_b.socket_path,
                                                                          "remote-b")
            raw = redis_py.Redis.from_url(server.url)
            corrupted: set[bytes] = set()
            try:
                for round_index in range(num_outages + 1):
                    keys = [key_of("remote", round_index, i) for i in range(48)]
                    writer.store(keys)
                    wait_until(lambda: writer.client.stats()["remote"]["pending_bytes"] == 0, 30)
                    for key in rng.sample(keys, num_flips):  # flip one byte of the value
                        name = redis_key(RemoteConfig().key_prefix, NAMESPACE.fingerprint + key)
                        value = bytearray(raw.get(name) or b"")
                        if value:
                            value[rng.randrange(len(value))] ^= 0xFF
                            raw.set(name, bytes(value))
                            corrupted.add(key)
                    served, num_wrong, _ = reader.recall(keys)
                    figures["wrong_pages"] += num_wrong
                    figures["corrupt_served"] += len(served & corrupted)
                    figures["remote_served"] += len(served)
                    if round_index < num_outages:  # kill Redis under traffic, then bring it back
                        server.stop()
                        # Requests that must reach the remote, so both daemons meet the outage:
                        # node b recalls pages nobody stored, node a writes pages through.
                        reader.recall([key_of("absent", round_index, i) for i in range(4)])
                        writer.store([key_of("offline", round_index, i) for i in range(8)])
                        wait_until(lambda: not writer.client.stats()["remote"]["connected"]
                                   and not reader.client.stats()["remote"]["connected"], 30)
                        server.start()
                        raw = redis_py.Redis.from_url(server.url)
                        figures["outages_caused"] += 1
                        wait_until(lambda: reader.client.stats()["remote"]["connected"]
                                   and writer.client.stats()["remote"]["connected"], 30)
                stats_a, stats_b = writer.client.stats(), reader.client.stats()
                figures.update(
                    corrupted_values=len(corrupted),
                    integrity_errors_reported=stats_b["remote"]["integrity_errors"],
                    outages_seen_a=stats_a["remote"]["outages"],
                    outages_seen_b=stats_b["remote"]["outages"],
                    connected_at_end=stats_a["remote"]["connected"]
                    and stats_b["remote"]["connected"],
                    check_problems=len(writer.client.check()) + len(reader.client.check()))
            finally:
                raw.close()
                writer.close()
                reader.close()
    finally:
        server.stop()
    return figures


def run(quick: bool, seed: int) -> Figures:
    """Every phase; the kill cycles run beside the light phases, load and fuzz run alone."""
    started = time.monotonic()
    phases: dict[str, Figures] = {}

    def timed(name: str, phase: Callable[[], Figures]) -> None:
        phase_started = time.monotonic()
        progress(f"{name} ...")
        phases[name] = phase()
        phases[name]["phase_s"] = round(time.monotonic() - phase_started, 1)
        progress(f"{name} done in {phases[name]['phase_s']} s")

    def rng(phase: int) -> random.Random:
        return random.Random(seed * 100 + phase)

    with ExitStack() as cleanup:
        work = Path(tempfile.mkdtemp(prefix="kvsoak-", dir="/tmp"))
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        # The kill cycles mostly wait on daemon start-up; the light phases share those seconds.
        with ThreadPoolExecutor(1) as background:
            kill = background.submit(timed, "kill", lambda: phase_kill(
                work, 20 if quick else 40, 30 if quick else 150, rng(1)))
            timed("client_kill", lambda: phase_client_kill(work, 3 if quick else 12, rng(2)))
            timed("corruption", lambda: phase_corruption(work, 8 if quick else 32, rng(3)))
            timed("full_disk", lambda: phase_full_disk(work))
            timed("remote", lambda: phase_remote(work, 2 if quick else 6, 3, rng(4)))
            kill.result()
        timed("load", lambda: phase_load(work, 16, 5.0 if quick else 60.0, seed))
        timed("fuzz", lambda: phase_fuzz(work, 100_000 if quick else 400_000, seed))
    phases = {name: phases[name]
              for name in ("kill", "client_kill", "load", "corruption", "fuzz", "full_disk",
                           "remote")}
    load = phases["load"]
    summary: Figures = {name: sum(int(p.get(name, 0)) for p in phases.values())
                        for name in MUST_BE_ZERO}
    summary.update(ops=load["ops"], p50_us=load["p50_us"], p99_us=load["p99_us"],
                   ops_per_s=load["ops_per_s"], kill_cycles=phases["kill"]["cycles"],
                   fuzz_frames=phases["fuzz"]["frames_sent"],
                   check_problems=sum(int(p.get("check_problems", 0)) for p in phases.values()),
                   quick=quick, seed=seed, elapsed_s=round(time.monotonic() - started, 1),
                   rss_overhead_mib=RSS_OVERHEAD_BYTES >> 20, phases=phases)
    return summary


def print_table(summary: Figures) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier soak ({'quick' if summary['quick'] else 'full'}, "
                        f"seed {summary['seed']}, {summary['elapsed_s']} s)")
    table.add_column("phase")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name in MUST_BE_ZERO:
        value = summary[name]
        table.add_row("all", f"{name} (must be 0)", f"[{'green' if value == 0 else 'red'}]{value}")
    for name in ("ops", "ops_per_s", "p50_us", "p99_us", "kill_cycles", "fuzz_frames"):
        table.add_row("all", name, str(summary[name]))
    for phase, figures in summary["phases"].items():
        table.add_section()
        for name, value in figures.items():
            table.add_row(phase, name, json.dumps(value) if isinstance(value, dict | list)
                          else str(value))
    Console().print(table)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--victim":
        run_victim(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (< 45 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    summary = run(options.quick, options.seed)
    if options.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    if any(summary[name] for name in MUST_BE_ZERO):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
