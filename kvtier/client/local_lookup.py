"""The client's side of the lookup plane: a namespace's key index, mapped read-only.

`open_index` opens the index the daemon named in a `lookup_index` reply, through
`/proc/<daemon pid>/fd/<fd>` (the pid from the socket's SO_PEERCRED, never from the daemon's
word), read-only, and checks it before trusting it: owned by the daemon's uid, sealed so that no
one but the daemon's own mapping can write it and its size cannot change (so reading it cannot
fault), with the generation and namespace the daemon said. The mapping is PROT_READ on a
read-only descriptor: this process cannot write it. `MappedIndex.longest_prefix` answers from
it with no system call (`kvtier.key_index`). Verbs: `open_index`, `MappedIndex.longest_prefix`,
`retired`, `close`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

from kvtier.errors import IndexRefusedError
from kvtier.key_index import INDEX_HEADER_BYTES, IndexReader, SegmentLayout

F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; Python's fcntl does not name it
REQUIRED_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class MappedIndex:
    """One namespace's index, mapped read-only."""

    def __init__(self, mapping: mmap.mmap, layout: SegmentLayout) -> None:
        self._mapping = mapping
        self._reader = IndexReader(memoryview(mapping), layout)
        self.longest_prefix = self._reader.longest_prefix
        self.generation = self._reader.generation

    @property
    def retired(self) -> bool:
        """Whether the daemon replaced this index (ask it for the new one) or stopped."""
        return self._reader.retired

    def close(self) -> None:
        """Unmap now if nothing reads it, else with the last reference (a lookup in another
        thread may still be reading)."""
        try:
            self._mapping.close()
        except BufferError:
            pass  # the reader's arrays hold views of it: unmapped when they go


def open_index(daemon_pid: int, daemon_uid: int, fd: int, generation: int, size_bytes: int,
               fingerprint: bytes) -> MappedIndex:
    """Map the daemon's index `fd` read-only after checking it.

    Raises:
        IndexRefusedError: it cannot be opened (another uid's daemon, /proc hidden), or it is not
            the sealed index of that namespace and generation (the fd was closed and reused).
    """
    try:
        descriptor = os.open(f"/proc/{daemon_pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise IndexRefusedError(f"cannot open the daemon's key index: {exc}") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != daemon_uid:
            raise IndexRefusedError("the daemon's key index is not a file of the daemon's uid")
        try:
            seals = fcntl.fcntl(descriptor, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise IndexRefusedError("the daemon's key index is not sealed against writes and "
                               "resizing")
        if info.st_size != size_bytes or size_bytes < INDEX_HEADER_BYTES:
            raise IndexRefusedError("the daemon's key index does not have the size it said")
        mapping = mmap.mmap(descriptor, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(descriptor)
    try:
        layout = SegmentLayout.from_header(mapping[:INDEX_HEADER_BYTES])
        if layout.size_bytes != size_bytes:
            raise ValueError("its layout does not fill it")
        index = MappedIndex(mapping, layout)
    except ValueError as exc:
        mapping.close()
        raise IndexRefusedError(f"the daemon's key index is damaged: {exc}") from None
    if index._reader.fingerprint != fingerprint or index.generation != generation:
        index.close()
        raise IndexRefusedError("the daemon's key index is of another namespace or generation")
    return index
