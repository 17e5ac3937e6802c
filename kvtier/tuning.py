"""Process tuning that must be in place before the interpreter starts: large copies.

glibc's memcpy switches to non-temporal stores only for copies larger than about three quarters
of the last-level cache; below that it writes through the cache, which for a multi-MiB page run
that nobody reads soon costs bandwidth. Measured here: 4 MiB copies at 7.9 GB/s by default,
11.6 GB/s with the threshold at 1 MiB (64 KiB copies unchanged). The threshold is a glibc tunable
read at start-up, so `kvtier serve` (and the benchmarks) re-execute themselves once with it set.
Verbs: `fast_copy_environment`, `reexec_with_fast_copies`.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NON_TEMPORAL_THRESHOLD_BYTES = 1 << 20
_REEXECUTED = "KVTIER_TUNED"  # set in the re-executed process, so it never loops


def fast_copy_environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` plus the non-temporal copy threshold, or None when it is set or does not apply."""
    if (platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64")
            or platform.libc_ver()[0] != "glibc"):
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    if NON_TEMPORAL_TUNABLE in tunables or env.get(_REEXECUTED):
        return None
    setting = f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_THRESHOLD_BYTES:#x}"
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{setting}" if tunables else setting,
            _REEXECUTED: "1"}


def reexec_with_fast_copies() -> None:
    """Replace this process with itself under `fast_copy_environment`; no-op when not needed.

    Call it first thing in a command, before threads or files are opened.
    """
    env = fast_copy_environment(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
