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
  held pool segments (open in /proc/<pid>/fd or mapped) return to what they were, its leases end,
  and a second client's pages and lease are untouched.
- load: 16 client processes for a bounded time doing lookup / store / recall / delete on
  overlapping keys (each stores and deletes only its own keys, lookups and recalls cross over),
  write-through with a disk tier large enough that nothing is dropped; lost = an acknowledged,
  never deleted key not served. Daemon RSS is sampled against host capacity + a stated overhead.
- corruption: bytes of `pages.slots` flipped while the daemon runs and while it is stopped: the
  page must be reported (failed recall, `check(verify_bytes=True)`) and then be a miss.
- fuzz: >= 100,000 frames (valid requests, bad values, random msgpack, random bytes, truncated
  frames, oversized length prefixes) over several connections; the daemon must keep its pid
  and answer.
- remote: two daemons (1 MiB host each) share a loopback redis-server (`kvtier.testing.redis`);
  node a stores rounds of pages (written through to Redis), node b recalls pages it never held,
  while Redis is killed and restarted between rounds (2, --quick; 6) and bytes of 3 values a
  round are flipped in Redis: node b must serve no wrong or corrupt page, count every corrupt
  value as an integrity error, see every outage and reconnect. Skipped without redis-server.
- full_disk: a small --disk-capacity (stores evict: it is a cache) and, as root, an 8 MiB tmpfs
  under a --disk-capacity that fits it, then filled by a file: stores fail naming a full file
  system, earlier pages stay byte-identical, the daemon keeps serving (skipped with a note if
  mounting fails).
- attacks: one client's load attacks (a 65,536-page store, pipelined 65,536-key lookups and
  pins, 16 looping Prometheus scrapers) while a neighbour process pings every 5 ms; for each,
  the neighbour's ping p50/p99/max without it (the quiet window just before) and with it, and
  the daemon's RSS before and after the store and after its pages are deleted.

Must be zero: wrong_pages, lost_pages, corrupt_served, leaked_segments, leaked_fds,
daemon_restarts_needed. `ops`, `p50_us`, `p99_us` are the load phase's. `--json` prints exactly
one JSON object on stdout; progress goes to stderr. --quick finishes in about a minute on 2 cores.

This file is the driver (flags, the order phases run in, the summary); each phase is a module of
bench/soak_phases/ (kill, client_kill, load, corruption, fuzz, full_disk, remote, attacks), what
they share is in bench/soak_phases/common.py.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from soak_phases.attacks import phase_attacks
from soak_phases.client_kill import phase_client_kill, run_victim
from soak_phases.common import MUST_BE_ZERO, RSS_OVERHEAD_BYTES, Figures, progress
from soak_phases.corruption import phase_corruption
from soak_phases.full_disk import phase_full_disk
from soak_phases.fuzz import phase_fuzz
from soak_phases.kill import phase_kill
from soak_phases.load import phase_load
from soak_phases.remote import phase_remote


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
        timed("attacks", lambda: phase_attacks(work, quick))
    phases = {name: phases[name]
              for name in ("kill", "client_kill", "load", "corruption", "fuzz", "full_disk",
                           "remote", "attacks")}
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
