"""Engine pools in GPU memory: opened by the daemon through CUDA IPC handles.

An engine allocates its KV pool on its GPU and registers it with `register_device_pool`, sending
the pool's CUDA IPC handle instead of a shared-memory name. The daemon maps that memory
(`DevicePool`) and `DevicePoolPages` moves pages between it and the host arena, as `PoolPages`
does for shared-memory pools. CuPy is imported here only, when a device pool is registered or
created: nothing on the CPU path needs it.

This is the per-page path (one device-to-host copy per page); the batched, full-duplex path is
`kvtier.transfer`. Verbs: `DevicePool.open`, `DevicePool.close`, `DevicePoolPages`,
`DeviceMemory.allocate` (client side: a pool with its IPC handle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import ProtocolError
from kvtier.pools import PoolLayout, StagedPages


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise ProtocolError("this kvtier cannot use GPU pools: CuPy is not installed "
                            "(pip install 'kvtier[cuda]')") from None
    return cupy


def _device_view(cupy: Any, base: Any, layout: PoolLayout) -> Any:
    """The pool as a `[num_pages, num_layers, 2, segment_bytes]` strided device view."""
    return cupy.lib.stride_tricks.as_strided(
        base[layout.offset_bytes :],
        shape=(layout.num_pages, layout.num_layers, 2, layout.segment_bytes),
        strides=(layout.page_stride_bytes, layout.layer_stride_bytes, layout.kv_stride_bytes, 1))


class DevicePool:
    """A client's GPU pool, mapped into the daemon through its CUDA IPC handle."""

    def __init__(self, cupy: Any, pointer: int, device: int, view: Any) -> None:
        self._cupy = cupy
        self._pointer = pointer
        self._device = device
        self.view = view

    @classmethod
    def open(cls, ipc_handle: bytes, size_bytes: int, layout: PoolLayout,
             device: int) -> DevicePool:
        """Map the pool behind `ipc_handle` (`size_bytes` on GPU `device`).

        Raises:
            ProtocolError: no CuPy, a bad handle or device, or a layout beyond `size_bytes`.
        """
        layout.validate(size_bytes)
        cupy = _cupy()
        try:
            with cupy.cuda.Device(device):
                pointer = cupy.cuda.runtime.ipcOpenMemHandle(ipc_handle)
        except Exception as exc:  # CuPy raises CUDARuntimeError for bad handles and devices
            raise ProtocolError(f"cannot open the CUDA IPC handle on device {device}: {exc}") from exc
        pool = cls(cupy, pointer, device, None)
        memory = cupy.cuda.UnownedMemory(pointer, size_bytes, pool, device)
        base = cupy.ndarray((size_bytes,), dtype=cupy.uint8,
                            memptr=cupy.cuda.MemoryPointer(memory, 0))
        pool.view = _device_view(cupy, base, layout)
        return pool

    @property
    def address(self) -> int:
        """The device address of the pool's first byte (where its layout's offsets start)."""
        return self._pointer

    def close(self) -> None:
        """Unmap the client's memory (idempotent)."""
        if self._pointer:
            self.view = None
            with self._cupy.cuda.Device(self._device):
                self._cupy.cuda.runtime.ipcCloseMemHandle(self._pointer)
            self._pointer = 0


class DevicePoolPages(StagedPages):
    """Pages of a GPU pool: a device-side gather of the strided page, then one copy each way."""

    def __init__(self, pool: DevicePool, page_ids: Sequence[int]) -> None:
        super().__init__(pool.view.shape[0], tuple(pool.view.shape[1:]), page_ids)
        self._cupy = pool._cupy
        self._device = pool._device
        self._pool = pool.view

    def _download(self, index: int, out: np.ndarray) -> None:
        # A page of a layer-first pool is strided on the device: gather it there, then one copy.
        with self._cupy.cuda.Device(self._device):
            self._cupy.ascontiguousarray(self._pool[self._ids[index]]).get(
                out=out.reshape(self._page_shape))

    def _upload(self, index: int, source: np.ndarray) -> None:
        with self._cupy.cuda.Device(self._device):
            self._pool[self._ids[index]] = self._cupy.asarray(source.reshape(self._page_shape))


class DeviceMemory:
    """Client side: a GPU buffer for a pool, and the CUDA IPC handle the daemon opens."""

    def __init__(self, cupy: Any, buffer: Any, device: int) -> None:
        self.buffer = buffer
        self.device = device
        self.size_bytes = int(buffer.nbytes)
        self.ipc_handle: bytes = cupy.cuda.runtime.ipcGetMemHandle(buffer.data.ptr)

    @classmethod
    def allocate(cls, layout: PoolLayout, device: int = 0) -> DeviceMemory:
        """A zeroed device buffer holding `layout`.

        Raises:
            ProtocolError: CuPy is not installed.
        """
        cupy = _cupy()
        with cupy.cuda.Device(device):
            buffer = cupy.zeros(layout.span_bytes, dtype=cupy.uint8)
        return cls(cupy, buffer, device)

    def pages(self, layout: PoolLayout) -> Any:
        """The buffer as the `[num_pages, num_layers, 2, segment_bytes]` device view."""
        return _device_view(_cupy(), self.buffer, layout)
