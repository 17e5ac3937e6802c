"""Named POSIX shared-memory segments (under /dev/shm) that other processes can map.

Not `multiprocessing.shared_memory`: its resource tracker unlinks segments it did not create when
a process exits, and it cannot create with mode 0600 or open read-only. Verbs: `create`, `attach`,
`close`, `unlink`, and `reclaim_orphans` for segments of processes that died.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Collection
from pathlib import Path

import numpy as np

from kvtier.errors import StorageError
from kvtier.sizes import format_bytes

SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "kvtier-host"  # every daemon's host arena is named ARENA_PREFIX-<pid>-<hex>


def new_segment_name(prefix: str = "kvtier") -> str:
    """A fresh, unguessable segment name with the owner's pid for people reading /dev/shm."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"


def _room_for_segments() -> str:
    """What bounds a segment's size, in words: /dev/shm's free space and the machine's RAM."""
    import psutil  # only on this error path

    stat = os.statvfs(SHM_DIR)
    return (f"{SHM_DIR} has {format_bytes(stat.f_bavail * stat.f_frsize)} free; this machine has "
            f"{format_bytes(psutil.virtual_memory().total)} of RAM")


def process_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (dead, not yet reaped by its parent) counts as gone.

    Only a missing /proc entry means gone: a read that fails otherwise (a process out of file
    descriptors gets EMFILE) says nothing, and taking it for death would unlink every live
    client's pool on the node.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def reclaim_orphans(prefixes: tuple[str, ...] = ("kvtier-host-", "kvtier-pool-"),
                    only_pids: Collection[int] | None = None) -> list[str]:
    """Unlink this user's kvtier segments whose creating process is gone; return their names.

    A daemon or client killed with SIGKILL cannot unlink its segments, and a host arena can be
    many GiB of RAM. Names carry the creator's pid; a live pid (even a reused one) is left alone,
    and so is any pid not in `only_pids` when it is given.
    """
    reclaimed = []
    uid = os.getuid()
    for path in SHM_DIR.glob("kvtier-*"):
        if not path.name.startswith(prefixes):
            continue
        try:
            pid = int(path.name.split("-")[2])
            if only_pids is not None and pid not in only_pids:
                continue
            if path.stat().st_uid != uid or process_alive(pid):
                continue
            path.unlink()
        except (ValueError, IndexError, OSError):
            continue
        reclaimed.append(path.name)
    return reclaimed


class SharedSegment:
    """One mapped shared-memory segment. Create with `create` or `attach`, never directly."""

    def __init__(self, name: str, size_bytes: int, buffer: mmap.mmap, owner: bool,
                 inode: tuple[int, int] = (0, 0)) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self.owner = owner
        self.inode = inode  # (st_dev, st_ino): what the name pointed to when it was opened
        self._mmap: mmap.mmap | None = buffer

    @classmethod
    def create(cls, name: str, size_bytes: int, mode: int = 0o600) -> SharedSegment:
        """Create segment `name` of `size_bytes` (fails if it exists) and map it read-write.

        Raises:
            StorageError: the segment exists or /dev/shm has no room.
        """
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            raise StorageError(f"shared-memory segment {name} already exists") from None
        try:
            # posix_fallocate, not ftruncate: a tmpfs without room must fail here, not SIGBUS later.
            os.posix_fallocate(fd, 0, size_bytes)
            buffer = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            info = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise StorageError(
                f"cannot create a {format_bytes(size_bytes)} shared-memory segment in {SHM_DIR}: "
                f"{exc.strerror or exc} ({_room_for_segments()})"
            ) from exc
        os.close(fd)
        return cls(name, size_bytes, buffer, owner=True, inode=(info.st_dev, info.st_ino))

    @classmethod
    def attach(cls, name: str, writable: bool = False) -> SharedSegment:
        """Map an existing segment, read-only unless `writable`.

        Raises:
            StorageError: the segment does not exist or cannot be mapped.
        """
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except OSError as exc:
            raise StorageError(f"cannot open shared-memory segment {name}: {exc}") from exc
        try:
            size_bytes = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            buffer = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, prot)
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot map shared-memory segment {name}: {exc}") from exc
        finally:
            os.close(fd)
        return cls(name, size_bytes, buffer, owner=False)

    def array(self) -> np.ndarray:
        """The segment as a flat uint8 array (read-only when mapped read-only)."""
        if self._mmap is None:
            raise StorageError(f"shared-memory segment {self.name} is closed")
        return np.frombuffer(self._mmap, dtype=np.uint8)

    def prefault(self) -> None:
        """Touch every memory page now: first-touch page faults make early copies 4x slower."""
        array = self.array()
        array[:: mmap.PAGESIZE] = 0

    def close(self) -> None:
        """Unmap the segment (idempotent). Arrays from `array()` must be dropped first."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A caller still holds a view; the mapping goes away with the last reference.
                pass
            self._mmap = None

    def unlink(self) -> None:
        """Remove the segment's name; mappings stay valid until closed (idempotent)."""
        (SHM_DIR / self.name).unlink(missing_ok=True)
