"""What the daemon's memory does around one large store and its delete (issue #24).

Run:

    python bench/bench_memory_back.py [--pages 65536] [--cycles 3] [--policy adaptive]
        [--env NAME=VALUE ...] [--json]

A daemon of this tree (host tier only, 128 MiB, no disk) gets `--pages` tiny pages (512 bytes:
the load is the number of keys, not bytes) in one store, then their delete, `--cycles` times.
Its /proc status is read before, after each store and once housekeeping has given back what it
will after each delete (RSS stopped falling for 3 s): RssAnon (the Python heap and the C heap),
RssShmem (the host arena in /dev/shm), in MiB. `anon_kept_mib` is what the last delete left of
the anonymous memory above the start. `--env` runs the daemon with extra environment (e.g.
PYTHONMALLOC=malloc, MALLOC_ARENA_MAX=2) to compare allocators in the same run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

import kvtier
from kvtier.client import Client, SharedPool
from kvtier.daemon.heap import IDLE_CHUNK_GRACE_S
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout
from kvtier.testing.daemon_process import DaemonProcess, serve_argv

# Settled: no fall for longer than an emptied arena chunk is kept before it goes back.
SETTLE_S = IDLE_CHUNK_GRACE_S + 3.0


def status_mib(pid: int) -> dict[str, float]:
    text = Path(f"/proc/{pid}/status").read_text()
    found = {name: re.search(rf"{name}:\s+(\d+) kB", text)
             for name in ("VmRSS", "RssAnon", "RssShmem")}
    return {name: int(match.group(1)) / 1024 if match else 0.0 for name, match in found.items()}


def settled(pid: int, timeout_s: float = 60.0) -> dict[str, float]:
    """/proc status once VmRSS has not fallen for SETTLE_S (housekeeping runs every second)."""
    last, since, deadline = status_mib(pid), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - since < SETTLE_S and time.monotonic() < deadline:
        time.sleep(0.25)
        now = status_mib(pid)
        if now["VmRSS"] < last["VmRSS"] - 0.5:
            since = time.monotonic()
        last = now
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=65_536)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--policy", default=None, help="host policy (default: the daemon's)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    layout = PoolLayout.page_first(args.pages, 1, 16, 1, 8, "float16")
    namespace = Namespace("memory-back", "float16", "page-first", 16, layout.page_bytes)
    keys = [i.to_bytes(16, "little") for i in range(args.pages)]
    env = dict(os.environ, PYTHONPATH=str(Path(kvtier.__file__).resolve().parents[1]),
               **dict(item.split("=", 1) for item in args.env))
    serve = ["--host-capacity", "128MiB", "--no-prefault", "--no-disk"]
    if args.policy:
        serve += ["--host-policy", args.policy]
    cycles: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as work, SharedPool(layout) as pool:
        socket_path = Path(work) / "k.sock"
        daemon = DaemonProcess(socket_path, serve_argv(socket_path, *serve, isolated=False), env)
        try:
            daemon.wait_ready(60)
            pool.pages[:] = np.random.default_rng(0).integers(0, 256, pool.pages.shape,
                                                              dtype=np.uint8)
            with Client(socket_path, client_name="memory-back") as client:
                handle = pool.register(client, namespace)
                start = settled(daemon.pid)
                for _ in range(args.cycles):
                    assert client.store(handle, keys, range(args.pages)).result().ok
                    stored = status_mib(daemon.pid)
                    assert client.delete(handle, keys) == args.pages
                    cycles.append({"stored": stored, "deleted": settled(daemon.pid)})
        finally:
            daemon.stop(30)
    anon_kept_mib = round(cycles[-1]["deleted"]["RssAnon"] - start["RssAnon"], 1)
    if args.json:
        print(json.dumps({"pages": args.pages, "env": args.env, "start": start, "cycles": cycles,
                          "anon_kept_mib": anon_kept_mib}))
        return
    row = "{:<12}{:>9.1f}{:>10.1f}{:>11.1f}"
    print(f"{'':<12}{'VmRSS':>9}{'RssAnon':>10}{'RssShmem':>11}   MiB, env {args.env or '-'}")
    print(row.format("start", *start.values()))
    for number, cycle in enumerate(cycles, 1):
        print(row.format(f"store {number}", *cycle["stored"].values()))
        print(row.format(f"delete {number}", *cycle["deleted"].values()))
    print(f"anon_kept_mib: {anon_kept_mib}")


if __name__ == "__main__":
    main()
