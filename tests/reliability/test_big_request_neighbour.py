"""One client's store of 65,536 pages leaves a neighbour's ping near its quiet time (issue #24,
finding 2).

Before the fix, CPython's full garbage collections walked every object of the page table with
the GIL held (75 ms for 65,536 pages here), several times during such a store: the neighbour's
pings waited for each. The neighbour (`kvtier.testing.neighbour`) runs in a process of its own
and pings every 5 ms; a ping's time counts from when it was due, so a stall counts once for every
ping it delayed. The bound is relative to the same neighbour's quiet pings in the same run, so a
busy machine moves both, and its floor (30 ms: the old stalls put the p99 at 63-72 ms on an idle
machine, the fix at 7-17) is in the daemon's CPU time: on a machine whose other work leaves the
daemon a third of a core, a 10 ms hold of the GIL takes 30 ms of the neighbour's time.

A machine can also be slow in a way no process sees in its own CPU times (a shared host taking
cycles from this VM: quiet pings here went from 0.38 to 0.8 ms p50 within an hour, and stores
of the fixed code then put the p99 at 23-76 ms). So the store is tried up to ATTEMPTS times,
its pages deleted between: the stalls the test is for come with every such store, the host's
noise rarely with three in a row.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import psutil

from kvtier.client import SharedPool
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout
from kvtier.testing import daemon as harness
from kvtier.testing.neighbour import Neighbour, p99

NUM_KEYS = 65_536  # kvtier.ipc.messages.MAX_KEYS_PER_REQUEST
# 512-byte pages: the load is the number of keys (32 MiB in all), not bytes.
LAYOUT = PoolLayout.page_first(NUM_KEYS, 1, 16, 1, 8, "float16")
NAMESPACE = Namespace("neighbour-test", "float16", "page-first", 16, LAYOUT.page_bytes)
QUIET_S = 1.0
WARM_S = 0.5
ATTEMPTS = 3
STALL_FLOOR_CPU_S = 0.03


def p99_s(neighbour: Neighbour, start: float, end: float) -> float:
    window = neighbour.window(start, end)
    assert len(window) > 50, f"{len(window)} pings in the window: no test"
    return p99(window)


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def test_a_store_of_65536_pages_leaves_a_neighbours_ping_fast(make_daemon, socket_dir: Path,
                                                              tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    daemon_process = psutil.Process(daemon.pid)
    verdicts: list[str] = []
    with daemon.client("attacker") as client, SharedPool(LAYOUT) as pool:
        handle = pool.register(client, NAMESPACE)
        pool.pages[:] = np.random.default_rng(0).integers(0, 256, pool.pages.shape,
                                                          dtype=np.uint8)
        keys = harness.random_keys(np.random.default_rng(1), NUM_KEYS)
        for _ in range(ATTEMPTS):
            with Neighbour(daemon.socket_path) as neighbour:  # its pings are read at its end
                time.sleep(WARM_S)  # its first pings connect and warm up: not the quiet
                quiet = time.monotonic()
                time.sleep(QUIET_S)  # the neighbour's quiet window: measured, not waited on
                started, started_cpu_s = time.monotonic(), cpu_s(daemon_process)
                assert client.store(handle, keys, range(NUM_KEYS)).result().ok
                ended, ended_cpu_s = time.monotonic(), cpu_s(daemon_process)
            passed, verdict = judge(neighbour, quiet, started, ended,
                                    ended_cpu_s - started_cpu_s)
            verdicts.append(verdict)
            if passed:
                break
            assert client.delete(handle, keys) == NUM_KEYS
    assert passed, "in every attempt:\n" + "\n".join(verdicts)
    print(verdicts[-1])


def judge(neighbour: Neighbour, quiet: float, started: float, ended: float,
          store_cpu_s: float) -> tuple[bool, str]:
    """Whether the neighbour's p99 during the store [started, ended] stayed within the bound
    the quiet window before it sets, and the figures."""
    quiet_p99_s = p99_s(neighbour, quiet, started)
    store_p99_s = p99_s(neighbour, started, ended)
    # The store keeps one daemon thread busy: the share of a core it got is the machine's load.
    cpu_share = min(1.0, store_cpu_s / (ended - started))
    bound_s = max(10 * quiet_p99_s, STALL_FLOOR_CPU_S / cpu_share)
    quiet_median_ms = statistics.median(neighbour.window(quiet, started)) * 1e3
    return store_p99_s < bound_s, (
        f"the neighbour's ping p99 was {store_p99_s * 1e3:.1f} ms during a {NUM_KEYS}-page "
        f"store of {ended - started:.1f} s (quiet: p99 {quiet_p99_s * 1e3:.2f} ms, p50 "
        f"{quiet_median_ms:.2f} ms; the daemon had {cpu_share:.2f} of a core; bound "
        f"{bound_s * 1e3:.0f} ms)")
