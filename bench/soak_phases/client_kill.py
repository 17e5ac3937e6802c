"""Soak phase `client_kill`: SIGKILL clients with stores and recalls in flight.

A client subprocess (`python bench/soak.py --victim SOCKET MODE`, `run_victim`) registers a pool,
stores and pins pages, starts a big store and/or recall and is SIGKILLed while they are in flight.
The daemon's fds and held pool segments return to what they were, its leases end, and a second
client's pages and lease are untouched.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

from kvtier.pools.layout import PoolLayout
from kvtier.testing.daemon import held_pool_segments, num_open_fds
from soak_phases.common import (
    Figures,
    Pager,
    key_of,
    page_content,
    running_daemon,
    serve_args,
    shm_files,
    wait_until,
)

VICTIM_PAGES = 256
SOAK_SCRIPT = Path(__file__).resolve().parents[1] / "soak.py"  # runs `run_victim`


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
                return (num_open_fds(daemon.pid), frozenset(held_pool_segments(daemon.pid)),
                        stats["num_leases"], len(stats["clients"]))

            baseline = state()
            for kill in range(num_kills):
                mode = ("store", "recall", "both")[kill % 3]
                victim = subprocess.Popen(
                    [sys.executable, str(SOAK_SCRIPT), "--victim", str(socket_path), mode],
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
