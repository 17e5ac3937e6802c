"""The pools and namespaces clients register, as the daemon holds them: `PoolRegistry`.

A sealed memfd pool arrives as a descriptor with its frame, is checked on it and mapped
(`SealedPool.adopt`); its pages move on the CPU lanes with plain memory copies. A pool
registered by /dev/shm name instead is opened once by name, checked on its descriptor
(`PoolFile.open`) and counted against the `FdBudget` while registered; a GPU pool is mapped through
its CUDA IPC handle (`MappedDevicePool.open`) and moves on the CUDA lanes of its device, opened with
the first such pool. Each registration stays within the client's caps: `max_pools_per_client` pools
and namespace handles, `max_namespaces_per_client` namespaces per connection and
`max_namespaces_per_peer` per process (uid and pid) over all its connections. Verbs:
`register_sealed`, `register_shared`, `register_device`, `open_namespace`, `unregister`, `pool`,
`release_namespaces`.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from collections import Counter

from kvtier.daemon.limits import FdBudget, Limits
from kvtier.daemon.session import RegisteredPool, Session
from kvtier.errors import CapacityError, ProtocolError, QuotaError
from kvtier.ipc import messages as m
from kvtier.keys import Namespace
from kvtier.pools.device import MappedDevicePool
from kvtier.pools.layout import DTYPE_BYTES, PoolLayout, PoolMemory
from kvtier.pools.pool_file import PoolFile
from kvtier.pools.sealed import SealedPool
from kvtier.store.page_store import PageStore
from kvtier.transfer.cpu import CpuBackend

log = logging.getLogger(__name__)

CPU_LANES = "cpu"  # the store's lanes key for shared-memory pools
_SEGMENT_NAME = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._-]{1,200}")
# A namespace's layout name: what engines use ("page-first", "vllm:cuda:layer-first",
# "page-first/hf"), never a path out of anywhere (no leading "/" or ".", no ".."): it names
# pages in logs and tools, and must not read as a file name that climbs.
_LAYOUT_NAME = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._:+/-]{0,127}")


class PoolRegistry:
    """Registers clients' pools and namespaces with one `PageStore`."""

    def __init__(self, store: PageStore, limits: Limits, fd_budget: FdBudget,
                 max_namespaces_per_client: int, max_namespaces_per_peer: int = 64,
                 lane_copy_threads: int | None = None) -> None:
        self.store = store
        self.limits = limits
        self.fd_budget = fd_budget
        self.max_namespaces_per_client = max_namespaces_per_client
        self.max_namespaces_per_peer = max_namespaces_per_peer
        # Per process (uid, pid): how many of its live connections registered each namespace.
        # Registrations run on the loop and (GPU pools) on copy threads.
        self._peer_namespaces: dict[tuple[int, int], Counter[bytes]] = {}
        self._peer_lock = threading.Lock()
        if store.host.arena is not None:
            # each lane copies a large batch with up to `lane_copy_threads` threads
            store.open_lanes(CPU_LANES, CpuBackend(lane_copy_threads))
        self._pool_ids = itertools.count(1)

    def pool(self, session: Session, pool_id: int) -> RegisteredPool:
        """The client's pool `pool_id`.

        Raises:
            ProtocolError: this connection registered no such pool.
        """
        try:
            return session.pools[pool_id]
        except KeyError:
            raise ProtocolError(f"unknown pool {pool_id}: "
                                f"register it on this connection first") from None

    def register_shared(self, session: Session, namespace: Namespace, layout: PoolLayout,
                        segment: str) -> int:
        """Open the client's shared-memory segment `segment` as a pool; its pool id.

        Raises:
            QuotaError: the client holds `max_pools_per_client` pools, or no descriptor is left.
            ProtocolError: a bad name, layout or file (the sentence says which).
            CapacityError: the client's namespaces are at their cap.
        """
        self._check_pool(session, namespace, layout)
        if segment == self.store.host.segment_name:
            raise ProtocolError("the host arena cannot be registered as a pool")
        if not _SEGMENT_NAME.fullmatch(segment):
            raise ProtocolError(f"bad segment name {segment!r}: use letters, digits, "
                                f"'.', '_' and '-' (at most 200), as in /dev/shm")
        arena = self.store.host.segment
        self.fd_budget.take(1, "new pool")  # the pool file stays open while registered
        try:
            pool_file = PoolFile.open(segment, session.uid,
                                      refused_inodes=[arena.inode] if arena is not None else [])
        except BaseException:
            self.fd_budget.give_back(1)
            raise
        try:
            layout.validate(pool_file.size_bytes)
            self._register_namespace(session, namespace)
        except BaseException:
            pool_file.close()
            self.fd_budget.give_back(1)
            raise
        lanes_key = CPU_LANES if CPU_LANES in self.store.lanes_by_key else ""
        memory = PoolMemory(layout, pool_file) if lanes_key else None
        return self._add(session, RegisteredPool(namespace, layout, pool_file, lanes_key=lanes_key,
                                                 memory=memory, fd_budget=self.fd_budget))

    def register_sealed(self, session: Session, namespace: Namespace, layout: PoolLayout,
                        fd: int, name: str) -> int:
        """Map the client's sealed memfd `fd` (received with the frame, owned here with one unit
        of the descriptor budget) as a pool; its pool id.

        Raises:
            QuotaError, ProtocolError, CapacityError: as `register_shared`; ProtocolError also
                names a pool that is not sealed.
        """
        try:
            self._check_pool(session, namespace, layout)
        except BaseException:
            os.close(fd)
            self.fd_budget.give_back(1)
            raise
        arena = self.store.host.segment
        label = name[:200] or f"fd {fd}"
        try:
            sealed = SealedPool.adopt(fd, label, session.uid, layout,
                                      refused_inodes=[arena.inode] if arena is not None else [])
        except BaseException:
            self.fd_budget.give_back(1)  # adopt closed it
            raise
        try:
            self._register_namespace(session, namespace)
        except BaseException:
            sealed.close()
            self.fd_budget.give_back(1)
            raise
        assert sealed.array is not None
        lanes_key = CPU_LANES if CPU_LANES in self.store.lanes_by_key else ""
        memory = PoolMemory(layout, sealed.array) if lanes_key else None
        return self._add(session, RegisteredPool(namespace, layout, None, lanes_key=lanes_key,
                                                 memory=memory, fd_budget=self.fd_budget,
                                                 sealed=sealed))

    def register_device(self, session: Session, namespace: Namespace, layout: PoolLayout,
                        request: m.RegisterPool) -> int:
        """Map the client's GPU pool from its CUDA IPC handle; its pool id.

        Raises:
            BackendUnavailableError: CuPy is not installed here.
            QuotaError, ProtocolError, CapacityError: as `register_shared`.
        """
        self._check_pool(session, namespace, layout)
        assert request.cuda_ipc_handle is not None  # only GPU pools are registered here
        device = MappedDevicePool.open(request.cuda_ipc_handle, request.size_bytes, layout,
                                       request.cuda_device, request.cuda_ipc_offset,
                                       request.cuda_pci_bus_id)
        try:
            self._register_namespace(session, namespace)
        except BaseException:
            device.close()
            raise
        lanes_key = self._cuda_lanes(device.device)
        memory = PoolMemory(layout, device.address) if lanes_key else None
        return self._add(session, RegisteredPool(namespace, layout, None, device, lanes_key,
                                                 memory))

    def open_namespace(self, session: Session, namespace: Namespace) -> int:
        """A handle on `namespace` holding no memory (lookup, pin, delete); its pool id.

        Raises:
            QuotaError: the client holds `max_pools_per_client` pools and handles.
            ProtocolError, CapacityError: as `register_shared`.
        """
        self._check_count(session)  # a handle costs the daemon what a pool's entry does
        self._register_namespace(session, namespace)
        return self._add(session, RegisteredPool(namespace, None, None))

    def unregister(self, session: Session, pool_id: int) -> None:
        """Forget the client's pool; its memory is let go when the copies using it end."""
        pool = self.pool(session, pool_id)
        del session.pools[pool_id]
        pool.close()

    def _check_count(self, session: Session) -> None:
        if len(session.pools) >= self.limits.max_pools_per_client:
            raise QuotaError(f"this client has {len(session.pools)} pools and namespace handles "
                             f"registered, its limit (daemon.max_pools_per_client); unregister "
                             f"one first")

    def _check_pool(self, session: Session, namespace: Namespace, layout: PoolLayout) -> None:
        self._check_count(session)
        if layout.dtype != namespace.dtype or layout.page_tokens != namespace.page_tokens:
            raise ProtocolError("the pool layout's dtype and page_tokens must match its namespace")
        layout.check_fields()  # page_bytes below is computed from them
        if layout.page_bytes != namespace.page_bytes:
            raise ProtocolError(f"the pool's pages are {layout.page_bytes} bytes but the "
                                f"namespace says {namespace.page_bytes}")

    def _add(self, session: Session, pool: RegisteredPool) -> int:
        pool_id = next(self._pool_ids)
        session.pools[pool_id] = pool
        return pool_id

    def _register_namespace(self, session: Session, namespace: Namespace) -> None:
        """`store.register`, within the connection's share of namespaces.

        Raises:
            CapacityError: the connection registered `max_namespaces_per_client` already.
        """
        check_namespace_names(namespace)
        fingerprint = namespace.fingerprint
        if fingerprint in session.namespace_fingerprints:
            self.store.register(namespace)  # known to this connection; the store may have let go
            return
        if len(session.namespace_fingerprints) >= self.max_namespaces_per_client:
            raise CapacityError(f"this connection registered {self.max_namespaces_per_client} "
                                f"namespaces, its limit (setting daemon.max_namespaces_per_client)"
                                f"; reuse one, or connect once per engine")
        peer = (session.uid, session.pid)
        with self._peer_lock:
            held = self._peer_namespaces.setdefault(peer, Counter())
            if fingerprint not in held and len(held) >= self.max_namespaces_per_peer:
                raise CapacityError(f"process {session.pid} registered {len(held)} namespaces "
                                    f"over its connections, its share (setting "
                                    f"daemon.max_namespaces_per_peer); reuse one")
            held[fingerprint] += 1  # claimed before the store call: a racing thread sees it
        try:
            self.store.register(namespace)
        except BaseException:
            self._release_peer_namespace(peer, fingerprint)
            raise
        session.namespace_fingerprints.add(fingerprint)

    def release_namespaces(self, session: Session) -> None:
        """The connection ended: its namespaces no longer count against its process's share."""
        peer = (session.uid, session.pid)
        for fingerprint in session.namespace_fingerprints:
            self._release_peer_namespace(peer, fingerprint)
        session.namespace_fingerprints.clear()

    def _release_peer_namespace(self, peer: tuple[int, int], fingerprint: bytes) -> None:
        with self._peer_lock:
            held = self._peer_namespaces.get(peer)
            if held is None:
                return
            held[fingerprint] -= 1
            if held[fingerprint] <= 0:
                del held[fingerprint]
            if not held:
                del self._peer_namespaces[peer]

    def _cuda_lanes(self, device_id: int) -> str:
        """The key of the store's CUDA lanes on GPU `device_id`, opened on first use; "" when
        none can run (the pool's pages then move page by page)."""
        lanes_key = f"cuda:{device_id}"
        if lanes_key in self.store.lanes_by_key or self.store.host.arena is None:
            return lanes_key if lanes_key in self.store.lanes_by_key else ""
        try:
            from kvtier.transfer.cuda import CudaBackend  # imports CuPy: only for GPU pools

            self.store.open_lanes(lanes_key, CudaBackend(device_id))
        except Exception as exc:  # no CuPy, no compiler, a bad device: fall back, and say so
            log.warning("no CUDA lanes on GPU %d (%s: %s); its pools move page by page",
                        device_id, type(exc).__name__, exc)
            return ""
        return lanes_key


def check_namespace_names(namespace: Namespace) -> None:
    """Refuse a client's namespace whose dtype is not one pages are made of, or whose layout
    name is not a plain name (a path, say).

    Raises:
        ProtocolError: naming the field.
    """
    if namespace.dtype not in DTYPE_BYTES:
        raise ProtocolError(f"unknown namespace dtype {namespace.dtype!r}; known: "
                            f"{', '.join(DTYPE_BYTES)}")
    if not _LAYOUT_NAME.fullmatch(namespace.layout):
        raise ProtocolError(f"bad namespace layout {namespace.layout!r}: a name of letters, "
                            f"digits and '.', '_', ':', '+', '/', '-' (at most 128, "
                            f"starting with a letter or digit, no '..')")
