"""Soak phase `full_disk`: a small disk cap (stores evict: it is a cache) and a file system that
really fills (as root, an 8 MiB tmpfs: the daemon starts with a capacity that fits, since one
the file system cannot hold is refused at start, then a filler file takes all but 2 MiB of it):
stores fail naming a full file system, earlier pages stay byte-identical, the daemon keeps serving.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from soak_phases.common import Figures, Pager, chunks, key_of, running_daemon, serve_args

FULL_FS_CAPACITY = "6MiB"  # fits the 8 MiB tmpfs with room for the index: the start is allowed
FILLER_LEAVES_BYTES = 2 << 20  # a few 1 MiB chunks of the slot file, far below its capacity


def _fill(path: Path, leave_bytes: int) -> None:
    """Take the file system's free space, all but `leave_bytes` (the daemon's stores then hit a
    really full file system long before its capacity)."""
    stat = os.statvfs(path.parent)
    take = stat.f_bavail * stat.f_frsize - leave_bytes
    block = b"\0" * (1 << 20)
    with path.open("wb") as filler:
        while take > 0:
            take -= filler.write(block[: min(take, len(block))])


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
    figures: Figures = {"full_fs": f"8 MiB tmpfs, --disk-capacity {FULL_FS_CAPACITY}, all but "
                                   f"{FILLER_LEAVES_BYTES >> 20} MiB then taken by a filler file"}
    try:
        config = work / "full.toml"
        config.write_text('[disk]\nchunk = "1MiB"\n')  # grow the slot file 1 MiB at a time
        socket_path = work / "full.sock"
        args = ("--config", str(config),
                *serve_args(mount_point / "disk", "1MiB", FULL_FS_CAPACITY, "--write-policy",
                            "write-through"))
        with running_daemon(socket_path, *args) as daemon:
            _fill(mount_point / "filler", FILLER_LEAVES_BYTES)
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
