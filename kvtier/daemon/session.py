"""A connected client's session: the pools it registered and the leases it holds.

`Session` is one connection's state in the daemon; the service ends it (its leases unpinned, its
pools unmapped) when the client disconnects or dies. `RegisteredPool` is one registered pool as
the daemon holds it: a sealed memfd (mapped: kvtier/pools/sealed.py), a shared-memory file
registered by name (copied with system calls, never mapped: see kvtier/pools/pool_file.py) or
mapped GPU memory, kept mapped while copies into or out of it run.
Verbs: `RegisteredPool.in_use`, `RegisteredPool.pages`, `RegisteredPool.close`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvtier.daemon.limits import FdBudget
from kvtier.errors import ProtocolError
from kvtier.keys import Namespace
from kvtier.pools.device import DevicePoolPages, MappedDevicePool
from kvtier.pools.layout import PoolLayout, PoolMemory
from kvtier.pools.pool_file import PoolFile
from kvtier.pools.pool_pages import MappedPoolPages, PoolFilePages, PoolPageAccess
from kvtier.pools.sealed import SealedPool


@dataclass(slots=True)
class RegisteredPool:
    """A client's registered page pool, held by the daemon: a shared-memory file (copied with
    system calls, never mapped: see kvtier/pools/pool_file.py) or mapped GPU memory."""

    namespace: Namespace
    layout: PoolLayout | None  # None: a namespace handle (`open_namespace`), no memory
    file: PoolFile | None
    device: MappedDevicePool | None = None
    lanes_key: str = ""  # the store's transfer engine that moves this pool's pages, if any
    memory: PoolMemory | None = None  # the pool as that engine addresses it
    # Copies in flight into or out of the pool (on copy threads): an unregister or a client's
    # death while one runs unmaps the pool only when the last one ends. A GPU pool unmapped
    # under a running kernel is undefined behaviour, not an error.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _num_users: int = 0
    _closing: bool = False
    fd_budget: FdBudget | None = None  # gets the segment's descriptor back when it is unmapped
    sealed: SealedPool | None = None  # a sealed memfd pool, mapped (then `file` is None)

    @contextmanager
    def in_use(self) -> Iterator[RegisteredPool]:
        """Hold the pool mapped while copies use it.

        Raises:
            ProtocolError: the pool is being unregistered.
        """
        with self._lock:
            if self._closing:
                raise ProtocolError("the pool was unregistered")
            self._num_users += 1
        try:
            yield self
        finally:
            with self._lock:
                self._num_users -= 1
                last = self._closing and not self._num_users
            if last:
                self._unmap()

    @property
    def mapped(self) -> bool:
        """Whether the client's memory is still held here (its file open, or its GPU memory
        mapped)."""
        return (self.file is not None or self.sealed is not None
                or (self.device is not None and self.device.view is not None))

    def pages(self, page_ids: list[int]) -> PoolPageAccess:
        """The `PageAccess` for these page ids of the pool, bound to its engine when it has one.

        Raises:
            ProtocolError: the handle has no memory (opened with `open_namespace`).
        """
        if self.layout is None:
            raise ProtocolError("this handle was opened with open_namespace and holds no pages: "
                                "register a pool to store or recall")
        if self.device is not None:
            pages: PoolPageAccess = DevicePoolPages(self.device, page_ids)
        elif self.sealed is not None and self.sealed.array is not None:
            pages = MappedPoolPages(self.layout.page_view(self.sealed.array), page_ids)
        elif self.file is not None:
            pages = PoolFilePages(self.file, self.layout, page_ids)
        else:  # `in_use` refuses a closing pool: only a caller that skipped it gets here
            raise ProtocolError("the pool was unregistered")
        if self.memory is not None:
            pages.bind_lanes(self.lanes_key, self.memory)
        return pages

    def close(self) -> None:
        """Unmap the client's memory now, or when the copies using it end."""
        with self._lock:
            self._closing = True
            idle = not self._num_users
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        if self.device is not None:
            self.device.close()
        if self.file is not None or self.sealed is not None:
            self.memory = None
            if self.file is not None:
                self.file.close()
                self.file = None
            if self.sealed is not None:
                self.sealed.close()
                self.sealed = None
            if self.fd_budget is not None:
                self.fd_budget.give_back(1)
                self.fd_budget = None


@dataclass(slots=True, weakref_slot=True)  # watched once closed (HeapKeeper.watch)
class Session:
    """One connected client and everything it holds."""

    client_id: int
    uid: int
    pid: int
    name: str = ""
    pools: dict[int, RegisteredPool] = field(default_factory=dict)
    lease_ids: set[int] = field(default_factory=set)
    # Every namespace this connection registered a pool in, for its lifetime: unregistering
    # does not make room, or register/unregister loops would spam the store anyway.
    namespace_fingerprints: set[bytes] = field(default_factory=set)
    # A descriptor received on the connection (SCM_RIGHTS) for the next register_pool; -1: none
    passed_fd: int = -1
