"""A client's sealed memfd pool, mapped by the daemon: `SealedPool`.

The client sends its pool's descriptor with its `register_pool` frame (SCM_RIGHTS). The daemon
checks what it received, not a name: a memory file owned by the client's uid, open read-write,
sealed `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL` (`kvtier.sealed_memory.check_sealed`), not the
daemon's own arena, large enough for the layout. Then it maps it: no one can shrink a sealed file,
so no copy through the mapping can fault, and the lanes copy with plain numpy copies, at memcpy
speed. A pool without the seals is refused by name (a client's /dev/shm segment is registered by
name instead, and copied by descriptor: `kvtier.pools.pool_file`).
Verbs: `SealedPool.adopt`, `SealedPool.close`.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvtier.errors import ProtocolError
from kvtier.pools.layout import PoolLayout
from kvtier.sealed_memory import check_sealed, map_sealed


class SealedPool:
    """A client pool mapped from its sealed memfd. Make with `adopt`.

    `array` is the pool as a flat uint8 array; the mapping lives as long as any view of it.
    """

    def __init__(self, name: str, mapping: mmap.mmap, array: np.ndarray) -> None:
        self.name = name
        self.size_bytes = array.nbytes
        self.array: np.ndarray | None = array
        self._mapping: mmap.mmap | None = mapping

    @classmethod
    def adopt(cls, fd: int, name: str, uid: int, layout: PoolLayout,
              refused_inodes: Sequence[tuple[int, int]] = ()) -> SealedPool:
        """Check and map the received descriptor `fd` (closed here, whatever happens: the
        mapping holds its own reference).

        Raises:
            ProtocolError: not a sealed memory file of `uid`'s, the daemon's own memory, or too
                small for `layout` (the sentence names the pool).
        """
        try:
            size_bytes = check_sealed(fd, name)
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) in refused_inodes:
                raise ProtocolError(f"pool {name} is the daemon's own memory, not a pool")
            if info.st_uid != uid:
                raise ProtocolError(f"pool {name} belongs to uid {info.st_uid}, not to this "
                                    f"client (uid {uid})")
            layout.validate(size_bytes)
            if size_bytes == 0:
                raise ProtocolError(f"pool {name} is empty")
            mapping, array = map_sealed(fd, size_bytes)
        finally:
            os.close(fd)
        return cls(name, mapping, array)

    def close(self) -> None:
        """Drop the daemon's references: the memory is unmapped once no copy holds a view."""
        self.array = None
        self._mapping = None
