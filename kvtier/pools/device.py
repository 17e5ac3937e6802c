"""Engine pools in GPU memory, as the daemon holds them: opened through CUDA IPC handles.

An engine allocates its KV pool on its GPU (`kvtier.client.DeviceMemory`) and registers it with
`register_device_pool`, sending the pool's CUDA IPC handle instead of a shared-memory name. The
daemon maps that memory (`MappedDevicePool`) and `DevicePoolPages` moves pages between it and the
host arena, as `MappedPoolPages` does for shared-memory pools. CuPy is loaded only when a device
pool is registered: nothing on the CPU path needs it.

This is the per-page path (one device-to-host copy per page); the batched, full-duplex path is
`kvtier.transfer`. Verbs: `MappedDevicePool.open`, `MappedDevicePool.close`, `DevicePoolPages`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import ProtocolError
from kvtier.gpu import allocation_range, device_view, load_cupy
from kvtier.pools.layout import PoolLayout
from kvtier.pools.pool_pages import PoolPageAccess

log = logging.getLogger(__name__)


def _device_at(cupy: Any, pci_bus_id: str) -> int:
    """This process's index of the GPU at `pci_bus_id`: indices differ between processes that
    see different CUDA_VISIBLE_DEVICES (an engine pinned to one GPU, the daemon seeing all).

    Raises:
        ProtocolError: no GPU this process sees is at that address.
    """
    try:
        return int(cupy.cuda.runtime.deviceGetByPCIBusId(pci_bus_id))
    except Exception as exc:  # CUDARuntimeError: an address this process has no GPU at
        raise ProtocolError(f"the daemon sees no GPU at PCI address {pci_bus_id!r}: {exc}"
                            ) from exc


class MappedDevicePool:
    """A client's GPU pool, mapped into the daemon through its CUDA IPC handle."""

    def __init__(self, cupy: Any, pointer: int, device: int, offset: int) -> None:
        self._cupy = cupy
        self._pointer = pointer  # what the handle mapped: the client's whole allocation
        self.device = device  # this process's index of the GPU holding the pool
        self.address = pointer + offset  # the device address of the pool's first byte
        self.view: Any = None

    @classmethod
    def open(cls, ipc_handle: bytes, size_bytes: int, layout: PoolLayout, device: int,
             offset: int = 0, pci_bus_id: str = "") -> MappedDevicePool:
        """Map the pool behind `ipc_handle`: `size_bytes` from `offset` into the allocation the
        handle maps, on the GPU at `pci_bus_id` or, without one, GPU `device` as this process
        counts them.

        Raises:
            BackendUnavailableError: CuPy is not installed.
            ProtocolError: a bad handle, device or bus id, a layout beyond
                `size_bytes`, or a pool that runs past the allocation (its kernels would fault
                the daemon's GPU context).
        """
        layout.validate(size_bytes)
        if offset < 0:
            raise ProtocolError(f"a pool's offset in its allocation cannot be negative: {offset}")
        cupy = load_cupy()
        if pci_bus_id:
            device = _device_at(cupy, pci_bus_id)
        try:
            with cupy.cuda.Device(device):
                pointer = cupy.cuda.runtime.ipcOpenMemHandle(ipc_handle)
        except Exception as exc:  # CuPy raises CUDARuntimeError for bad handles and devices
            raise ProtocolError(f"cannot open the CUDA IPC handle on device {device}: "
                                f"{exc}") from exc
        pool = cls(cupy, pointer, device, offset)
        try:
            with cupy.cuda.Device(device):
                _, mapped_bytes = allocation_range(pointer)
        except ProtocolError as exc:  # a driver that keeps no range for imported memory
            log.warning("cannot bound a GPU pool by the memory its handle maps: %s", exc)
            mapped_bytes = offset + size_bytes
        if offset + size_bytes > mapped_bytes:
            pool.close()
            raise ProtocolError(f"the pool ({size_bytes} bytes from offset {offset}) runs past "
                                f"the {mapped_bytes} bytes its handle maps")
        memory = cupy.cuda.UnownedMemory(pool.address, size_bytes, pool, device)
        base = cupy.ndarray((size_bytes,), dtype=cupy.uint8,
                            memptr=cupy.cuda.MemoryPointer(memory, 0))
        pool.view = device_view(cupy, base, layout)
        return pool

    def close(self) -> None:
        """Unmap the client's memory (idempotent)."""
        if self._pointer:
            self.view = None
            with self._cupy.cuda.Device(self.device):
                self._cupy.cuda.runtime.ipcCloseMemHandle(self._pointer)
            self._pointer = 0


class DevicePoolPages(PoolPageAccess):
    """Pages of a GPU pool: a device-side gather of the strided page, then one copy each way."""

    def __init__(self, pool: MappedDevicePool, page_ids: Sequence[int]) -> None:
        super().__init__(pool.view.shape[0], tuple(pool.view.shape[1:]), page_ids)
        self._cupy = pool._cupy
        self._device = pool.device
        self._pool = pool.view

    def _download(self, index: int, out: np.ndarray) -> None:
        # A page of a layer-first pool is strided on the device: gather it there, then one copy.
        with self._cupy.cuda.Device(self._device):
            self._cupy.ascontiguousarray(self._pool[self._ids[index]]).get(
                out=out.reshape(self._page_shape))

    def _upload(self, index: int, source: np.ndarray) -> None:
        with self._cupy.cuda.Device(self._device):
            self._pool[self._ids[index]] = self._cupy.asarray(source.reshape(self._page_shape))

    def _finish_uploads(self) -> None:
        # The copies and strided assignments ran on the current stream, asynchronously: the
        # pages must be in the pool before the recall is reported done, and their sources (host
        # slots, staging rows) may be reused once the batch returns.
        with self._cupy.cuda.Device(self._device):
            self._cupy.cuda.get_current_stream().synchronize()
