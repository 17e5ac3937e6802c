"""A watchdog that reaps what the test harnesses started once the process that started them is
gone, however it went: a clean exit, SIGTERM, SIGKILL, pytest-timeout's `os._exit`, Ctrl-C.

An atexit or session-finish hook runs only when Python gets to run it, and a hung or killed test
run left `redis-server` processes and /dev/shm/kvtier-* segments (GiBs of RAM) behind. So the
reaper is a separate small process, started on the first `watch`: it holds the read end of a
pipe whose write end only the watched process holds (not inheritable, so no child keeps it
open), reads the pids the harnesses register on it, and at end of file (the watched process is
gone) SIGKILLs those still running and unlinks the segments named after any of them or after the
watched process itself (names carry the creator's pid, kvtier/shm.py). A registered pid is
killed only while it is the same process (its start time in /proc matches), never a reused pid.

Verbs: `start`, `watch(pid)`, `reaper_pid`. Run as a script by `watch` (stdlib only: it must start
without kvtier's imports): `python reaper.py WATCHED_PID`, the pipe on its stdin.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

SHM_DIR = Path("/dev/shm")

_lock = threading.Lock()
_pipe_owner = 0  # the pid that opened the pipe: a forked child must open its own
_pipe_fd = -1
_reaper_pid: int | None = None


def start() -> None:
    """Start this process's reaper (once): from then on the segments named after this process
    are unlinked once it is gone, even if it never gets to unlink them itself."""
    global _pipe_owner, _pipe_fd, _reaper_pid
    with _lock:
        if _pipe_owner == os.getpid():
            return
        read_fd, write_fd = os.pipe()  # both close on exec (PEP 446): no other child holds one
        # posix_spawn, not Popen: a Popen still running at exit warns, and this one always is.
        _reaper_pid = os.posix_spawn(
            sys.executable, [sys.executable, "-I", __file__, str(os.getpid())], os.environ,
            file_actions=[(os.POSIX_SPAWN_DUP2, read_fd, 0),
                          (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)],
            setsid=True)
        os.close(read_fd)
        _pipe_owner, _pipe_fd = os.getpid(), write_fd


def watch(pid: int) -> None:
    """Have process `pid` (a server or daemon this process started) killed, and the segments
    named after it unlinked, once this process is gone."""
    start()
    with _lock:
        os.write(_pipe_fd, f"{pid}\n".encode())


def reaper_pid() -> int | None:
    """The reaper's process id, once started."""
    return _reaper_pid


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time since boot), or None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _reap(watched_pid: int, started: dict[int, str | None]) -> None:
    for pid, start_time in started.items():
        if start_time is not None and _start_time(pid) == start_time:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    owners = {str(watched_pid), *map(str, started)}
    for path in SHM_DIR.glob("kvtier-*"):
        parts = path.name.split("-")
        if len(parts) >= 4 and parts[2] in owners:
            path.unlink(missing_ok=True)


def _main(watched_pid: int) -> None:
    # Ctrl-C reaches the whole foreground process group; the reaper has its own session, and
    # ignores both anyway: its job starts when the watched process ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started: dict[int, str | None] = {}
    for line in sys.stdin:
        pid = int(line)
        started[pid] = _start_time(pid)
    _reap(watched_pid, started)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
