"""Shared-memory segments: orphan reclaim never takes a live process's segment (issue #19)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.shm import SharedSegment, new_segment_name, reclaim_orphans


def test_a_process_out_of_fds_reclaims_no_live_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon out of file descriptors (issue #19, item 2) read EMFILE from /proc/<pid>/stat
    as "that process is dead" and unlinked every live client's pool on the node."""
    live = SharedSegment.create(new_segment_name("kvtier-pool"), 4096)
    read_text = Path.read_text

    def out_of_fds(path: Path, *args: object, **kwargs: object) -> str:
        if str(path).startswith("/proc/"):
            raise OSError(errno.EMFILE, "Too many open files")
        return read_text(path, *args, **kwargs)

    try:
        monkeypatch.setattr(Path, "read_text", out_of_fds)
        reclaimed = reclaim_orphans(("kvtier-pool-",))
        monkeypatch.undo()
        assert live.name not in reclaimed
        assert Path("/dev/shm", live.name).exists()
    finally:
        live.close()
        live.unlink()


def test_a_dead_process_segment_is_reclaimed_and_a_live_one_kept() -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = Path("/dev/shm", f"kvtier-pool-{child.stdout.strip()}-{os.urandom(6).hex()}")
    dead.write_bytes(b"x")
    live = SharedSegment.create(new_segment_name("kvtier-pool"), 4096)
    try:
        reclaimed = reclaim_orphans(("kvtier-pool-",))
        assert dead.name in reclaimed and not dead.exists()
        assert live.name not in reclaimed and Path("/dev/shm", live.name).exists()
    finally:
        dead.unlink(missing_ok=True)
        live.close()
        live.unlink()
