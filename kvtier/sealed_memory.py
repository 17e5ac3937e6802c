"""Sealed memfds: pool memory a client can hand the daemon, and the daemon may map.

A pool is a memfd created with `MFD_ALLOW_SEALING`, sized to its layout, then sealed
`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`: from then on nobody, its creator included, can change
its size (`ftruncate` fails with EPERM) or lift the seals. A mapping of it can therefore never
run past the end of the file, so the daemon maps it and copies with plain memory copies, with no
SIGBUS possible whatever the client does. The client passes the descriptor over the control
socket (`SCM_RIGHTS`); the daemon checks the seals on the descriptor it received, never a name.

A leaf module (numpy and the standard library): the client creates, the daemon adopts.
Verbs: `create_sealed`, `map_sealed`, `check_sealed`, `SEALS_NEEDED`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

import numpy as np

from kvtier.errors import ProtocolError

SEALS_NEEDED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Either would make the daemon's writable mapping fail (or a recall's writes): refused by name.
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)


def create_sealed(name: str, size_bytes: int) -> int:
    """A new memfd of `size_bytes` (zeroed), sealed against shrinking, growing and unsealing.

    Returns the descriptor (close-on-exec); the caller owns it.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS_NEEDED)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_sealed(fd: int, size_bytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Map `size_bytes` of `fd` shared, read-write: the mapping and a flat uint8 view of it.

    The view keeps the mapping alive: the memory is unmapped only when the last array over it
    is gone, so no copy can outlive it.
    """
    mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)


def check_sealed(fd: int, name: str) -> int:
    """Check a received pool descriptor before it is mapped; its size in bytes.

    Raises:
        ProtocolError: it is not a regular file, not open read-write, or not sealed
            `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL` (or sealed against writes); the sentence
            names the pool `name`.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ProtocolError(f"pool {name}: the descriptor is not a memory file")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise ProtocolError(f"pool {name}: the descriptor is not open read-write")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: a file system without seals (a disk file, a pipe)
        seals = 0
    if seals & SEALS_NEEDED != SEALS_NEEDED:
        raise ProtocolError(f"pool {name} is not sealed against shrinking and growing (seals "
                            f"{seals:#x}, needs F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL): create "
                            f"it with kvtier.client.SharedPool or kvtier.sealed_memory."
                            f"create_sealed")
    if seals & _WRITE_SEALS:
        raise ProtocolError(f"pool {name} is sealed against writes; recalls could not land")
    return info.st_size
