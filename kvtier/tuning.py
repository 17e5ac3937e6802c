"""Process tuning that must be in place before the interpreter starts: copies, buffers, arenas.

All are glibc tunables, read at start-up, so `kvtier serve` (and the benchmarks) re-execute
themselves once with them set.

- Large copies: glibc's memcpy switches to non-temporal stores only for copies larger than about
  three quarters of the last-level cache; below that it writes through the cache, which for a
  multi-MiB page run that nobody reads soon costs bandwidth. Measured here: 4 MiB copies at
  7.9 GB/s by default, 11.6 GB/s with the threshold at 1 MiB (64 KiB copies unchanged). x86-64
  only.
- Large buffers: by default a freed multi-MiB buffer goes back to the kernel (munmap, or a heap
  trim) and the next one of that size faults in again page by page. The remote tier receives
  every 2 MiB page as a fresh buffer; with buffers up to 4 MiB kept in the heap and up to 64 MiB
  of free heap kept before trimming, recall of 2 MiB pages from Redis went from 0.67-0.88 of a
  raw GET loop (wide spread, from faults) to 0.83-0.85 (bench/bench_remote.py, 4 runs each).
- One heap: glibc gives each thread that allocates its own arena, and `malloc_trim` returns the
  free top of the main one only, so what a large request's bulk thread allocated stays resident
  after it is freed, up to the trim threshold above. With one arena, the daemon's housekeeping
  gives it back: after two stores and deletes of 65,536 pages the daemon kept 59.9 MiB more
  than at start with its tables shrunk, 37.6 with one arena as well
  (`bench/bench_memory_back.py --cycles 2`); the hot paths' ratios moved within their noise
  (`bench/perf_check.py`, alternating runs).

Verbs: `tuned_environment`, `reexec_tuned`.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NON_TEMPORAL_THRESHOLD_BYTES = 1 << 20
MMAP_THRESHOLD_TUNABLE = "glibc.malloc.mmap_threshold"
MMAP_THRESHOLD_BYTES = 4 << 20
TRIM_THRESHOLD_TUNABLE = "glibc.malloc.trim_threshold"
TRIM_THRESHOLD_BYTES = 64 << 20
ARENA_MAX_TUNABLE = "glibc.malloc.arena_max"
_REEXECUTED = "KVTIER_TUNED"  # set in the re-executed process, so it never loops


def tuned_environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` plus the tunables it lacks, or None when none applies or all are set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or env.get(_REEXECUTED):
        return None
    wanted = {MMAP_THRESHOLD_TUNABLE: MMAP_THRESHOLD_BYTES,
              TRIM_THRESHOLD_TUNABLE: TRIM_THRESHOLD_BYTES, ARENA_MAX_TUNABLE: 1}
    if platform.machine() in ("x86_64", "AMD64"):
        wanted[NON_TEMPORAL_TUNABLE] = NON_TEMPORAL_THRESHOLD_BYTES
    tunables = env.get("GLIBC_TUNABLES", "")
    missing = [f"{name}={value:#x}" for name, value in wanted.items() if name not in tunables]
    if not missing:
        return None
    return {**env, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, *missing])),
            _REEXECUTED: "1"}


def reexec_tuned() -> None:
    """Replace this process with itself under `tuned_environment`; no-op when not needed.

    Call it first thing in a command, before threads or files are opened.
    """
    env = tuned_environment(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
