"""A real kvtier daemon process to test against, and the tools to talk to it.

`DaemonProcess` is the harness of `kvtier.testing.daemon_process` with the suite's defaults and
checks: `start` runs `python -m kvtier.cli.main serve` (this checkout's kvtier, not `-I`) with a
disk tier and waits for its "kvtier ready" log line; the reaper kills it if the test process
dies first; `stop_and_check` sends SIGTERM and checks for a clean exit that removes the socket
and its lock file. `RawConnection` speaks frames of plain dicts, for bad input. `Filler` pushes
other pages out of the host tier. Checks raise AssertionError, so a test runner reports them as
failures (they are not asserts: they hold under `python -O` too).

Verbs: `DaemonProcess.start` / `wait_exit` / `assert_logged` / `stop_and_check` / `client`,
`running_daemon`, `assert_sound`, `wait_until`, `poll_until`, `num_open_fds`, `held_pool_segments`,
`make_layout`, `namespace_for`, `fill_random`, `snapshot`, `Filler.overflow_host`,
`RawConnection.send` / `reply` / `call`. No pytest here: the fixtures built on these are in
`kvtier.testing.fixtures`.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import msgspec
import numpy as np

from kvtier.client import Client, SharedPool
from kvtier.ipc import messages as m
from kvtier.ipc.frames import pack_frame, recv_frame
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout
from kvtier.testing import daemon_process as launcher
from kvtier.testing import reaper

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.01  # between a `poll_until`'s tries
HOST_CAPACITY = "64MiB"  # the test daemon's tiers, as `kvtier serve` flags take them
DISK_CAPACITY = "256MiB"
HOST_CAPACITY_BYTES = 64 << 20
# 16 tokens x 4 heads x 64 dims x 2 bytes = 8 KiB per K or V segment; x 4 layers x 2 = 64 KiB.
PAGE_BYTES = 64 << 10
HOST_PAGES = HOST_CAPACITY_BYTES // PAGE_BYTES
LAYOUT_KINDS = {"page-first": PoolLayout.page_first, "layer-first": PoolLayout.layer_first}


class DaemonProcess(launcher.DaemonProcess):
    """`kvtier.testing.daemon_process.DaemonProcess` with the test's defaults and checks."""

    def __init__(self, socket_path: Path, disk_path: Path, argv: list[str],
                 env: Mapping[str, str] | None = None) -> None:
        super().__init__(socket_path, argv, env)
        reaper.watch(self.pid)  # killed, its arena unlinked, even if this process dies first
        self.lock_path = socket_path.with_name(socket_path.name + ".lock")
        self.disk_path = disk_path

    # A narrower factory than the base's, on purpose: every test daemon has a disk tier, so its
    # path comes before the serve flags; code holding a base DaemonProcess never calls this one.
    @classmethod
    def start(cls, socket_path: Path, disk_path: Path,  # type: ignore[override]
              *extra_args: str, host_capacity: str = HOST_CAPACITY,
              disk_capacity: str = DISK_CAPACITY, wait_ready: bool = True,
              env: Mapping[str, str] | None = None) -> DaemonProcess:
        """Start a daemon with `env` (default: this process's); with `wait_ready`, return only
        once it logged that it is ready."""
        argv = launcher.serve_argv(socket_path, "--host-capacity", host_capacity, "--disk-path",
                                   str(disk_path), "--disk-capacity", disk_capacity,
                                   "--no-prefault", *extra_args, isolated=False)
        daemon = cls(socket_path, disk_path, argv, env)
        if wait_ready:
            daemon.wait_ready(READY_TIMEOUT_S)
        return daemon

    def assert_logged(self, text: str, timeout_s: float = 30.0) -> None:
        """Block until the daemon logged a line containing `text`; fail the test otherwise."""
        if not self.wait_for_log(text, timeout_s):
            raise AssertionError(f"the daemon never logged {text!r}:\n{self.log()}")

    def stop_and_check(self) -> None:
        """SIGTERM; check for exit code 0 and that the socket and its lock file are gone."""
        self.process.send_signal(signal.SIGTERM)
        code = self.wait_exit(STOP_TIMEOUT_S)
        if code != 0:
            raise AssertionError(f"kvtier daemon exited with {code}:\n{self.log()}")
        if self.socket_path.exists():
            raise AssertionError("the daemon left its socket behind")
        if self.lock_path.exists():
            raise AssertionError("the daemon left its lock file behind")

    def client(self, name: str = "test") -> Client:
        return Client(self.socket_path, client_name=name, timeout_s=60.0)

    def num_open_fds(self) -> int:
        return num_open_fds(self.pid)

    def held_pool_segments(self) -> set[str]:
        """Names of the client pool segments the daemon has open or mapped now."""
        return held_pool_segments(self.pid)

    def peak_virtual_bytes(self) -> int:
        """VmPeak: the most address space the daemon ever had mapped."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmPeak in /proc/<pid>/status")


def num_open_fds(pid: int) -> int:
    """How many file descriptors process `pid` has open now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def held_pool_segments(pid: int) -> set[str]:
    """Names of the client pool segments process `pid` (a daemon) has open or mapped now: open is
    how it copies them, mapped is what a leak would look like."""
    held = Path(f"/proc/{pid}/maps").read_text()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += "\n" + os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
    # A /dev/shm segment shows as its path, a memfd as /memfd:NAME (deleted)
    return set(re.findall(r"(?:/dev/shm/|/memfd:)(kvtier-pool-[0-9]+-[0-9a-f]+)", held))


@contextmanager
def running_daemon(disk_path: Path, *serve_args: str) -> Iterator[DaemonProcess]:
    """A daemon (the test defaults, then `serve_args`) on a socket in a fresh short directory,
    for the block: stopped and checked for a clean exit when the block ends (killed instead if it
    raised, or if the daemon would not stop), the directory removed."""
    socket_dir = short_socket_dir()
    process = DaemonProcess.start(socket_dir / "k.sock", disk_path, *serve_args)
    try:
        yield process
        process.stop_and_check()
    finally:
        if process.running:
            process.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)


def assert_sound(client: Client) -> None:
    """The daemon's integrity walk finds nothing, with and without reading every disk page."""
    for verify_bytes in (False, True):
        problems = client.check(verify_bytes=verify_bytes)
        if problems:
            raise AssertionError(f"integrity walk (verify_bytes={verify_bytes}): {problems}")


def remove_shm_segments(prefix: str) -> None:
    """Unlink the /dev/shm segments whose name starts with `prefix` (left by killed processes)."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix):
            Path("/dev/shm", name).unlink(missing_ok=True)


def short_socket_dir() -> Path:
    """A fresh directory under /tmp: a test runner's tmp paths can exceed the 108-byte socket
    limit."""
    return Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))


def poll_until(predicate: Callable[[], bool], timeout_s: float,
               interval_s: float = POLL_INTERVAL_S) -> bool:
    """Repeat `predicate` (a round trip to the daemon, a /proc read), pausing `interval_s` between
    tries, until it holds (True) or `timeout_s` has passed (False). The pause leaves the CPU to
    the daemon being waited for: a tight loop of round trips starves it on a small machine."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """`poll_until`, failing the test with `what` when `timeout_s` passes first."""
    if not poll_until(predicate, timeout_s):
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def readline_within(stream: IO[str], timeout_s: float) -> str:
    """The next line of a child's pipe, failing after `timeout_s` instead of hanging."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no line from the child within {timeout_s} s") from None


def make_layout(kind: str, num_pages: int) -> PoolLayout:
    """A float16 pool of 64 KiB pages (4 layers, 16 tokens, 4 heads, 64 dims)."""
    return LAYOUT_KINDS[kind](num_pages, 4, 16, 4, 64, "float16")


def namespace_for(layout: PoolLayout, model_id: str, kind: str = "page-first") -> Namespace:
    return Namespace(model_id, layout.dtype, kind, layout.page_tokens, layout.page_bytes)


def random_keys(rng: np.random.Generator, num_keys: int) -> list[bytes]:
    return [rng.bytes(16) for _ in range(num_keys)]


def fill_random(pool: SharedPool, rng: np.random.Generator, page_ids: range | list[int]) -> None:
    for page_id in page_ids:
        pool.pages[page_id] = rng.integers(0, 256, pool.pages.shape[1:], dtype=np.uint8)


def snapshot(pool: SharedPool, page_ids: range | list[int]) -> np.ndarray:
    """Copies of the pages, for comparing after the daemon wrote into the pool."""
    return np.stack([pool.pages[i].copy() for i in page_ids])


def namespace_spec(namespace: Namespace) -> dict:
    return {name: getattr(namespace, name) for name in m.NamespaceSpec.__struct_fields__}


def layout_spec(layout: PoolLayout) -> dict:
    return {name: getattr(layout, name) for name in m.LayoutSpec.__struct_fields__}


class Filler:
    """Fresh pages in their own namespace, stored to push everything else out of the host tier."""

    def __init__(self, client: Client, pool: SharedPool) -> None:
        self._client = client
        self._pool = pool
        self._rng = np.random.default_rng()  # unseeded: filler keys must never repeat
        self.handle = pool.register(client, namespace_for(pool.layout, "filler"))

    def overflow_host(self, num_pages: int = HOST_PAGES + HOST_PAGES // 4) -> None:
        """Store `num_pages` never-seen pages: more than the host tier holds, by default."""
        num_pool_pages = self._pool.layout.num_pages
        for start in range(0, num_pages, num_pool_pages):
            count = min(num_pool_pages, num_pages - start)
            result = self._client.store(self.handle, random_keys(self._rng, count),
                                        range(count)).result()
            if not result.ok:
                raise AssertionError(f"a filler store failed: {result}")


class RawConnection:
    """A bare socket speaking frames of plain dicts, for input the client library never sends."""

    def __init__(self, socket_path: Path, timeout_s: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(socket_path))

    def send(self, **fields: object) -> None:
        self.sock.sendall(pack_frame(msgspec.msgpack.encode(fields)))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> m._Reply:
        """The next reply, decoded with the client's own schema (so it must be well formed)."""
        return m.reply_decoder.decode(recv_frame(self.sock, 1 << 30))

    def call(self, **fields: object) -> m._Reply:
        self.send(**fields)
        return self.reply()

    def closed_by_peer(self) -> bool:
        """True when the daemon closed the connection (nothing more will come)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()
