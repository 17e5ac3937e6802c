"""The client's pool in GPU memory: a device buffer and the CUDA IPC handle the daemon opens.

An engine on a GPU allocates its KV pool here (or wraps memory its own library allocated) and
registers it with `register_device_pool`; the daemon maps it through the handle
(`kvtier.pools.device.MappedDevicePool`). CuPy is loaded only when one is made.
Verbs: `DeviceMemory.allocate`, `DeviceMemory.wrap`, `DeviceMemory.pages`.
"""

from __future__ import annotations

from typing import Any

from kvtier.gpu import allocation_range, device_view, load_cupy
from kvtier.pools.layout import PoolLayout

# A pool gets a device allocation of its own, rounded up to the driver's 2 MiB granule: a CUDA
# IPC handle maps the whole allocation holding a buffer, so nothing else of the client's shows.
POOL_ALLOCATION_GRANULE_BYTES = 2 << 20


class DeviceMemory:
    """Client side: a GPU buffer for a pool, and the CUDA IPC handle the daemon opens."""

    def __init__(self, cupy: Any, buffer: Any, device: int) -> None:
        self.buffer = buffer
        self.device = device
        self.size_bytes = int(buffer.nbytes)
        with cupy.cuda.Device(device):
            pointer = int(buffer.data.ptr)
            self.ipc_handle: bytes = cupy.cuda.runtime.ipcGetMemHandle(pointer)
            base, _ = allocation_range(pointer)
            self.pci_bus_id: str = cupy.cuda.runtime.deviceGetPCIBusId(device)
        # The handle maps the whole allocation holding the buffer, which CuPy's memory pool or
        # the driver may share among buffers: the daemon finds the pool this far into it.
        self.ipc_offset = pointer - base

    @classmethod
    def allocate(cls, layout: PoolLayout, device: int = 0) -> DeviceMemory:
        """A zeroed device buffer holding `layout`.

        Raises:
            BackendUnavailableError: CuPy is not installed.
        """
        cupy = load_cupy()
        granule = POOL_ALLOCATION_GRANULE_BYTES
        with cupy.cuda.Device(device):
            memory = cupy.cuda.Memory(-(-layout.span_bytes // granule) * granule)
            buffer = cupy.ndarray((layout.span_bytes,), dtype=cupy.uint8,
                                  memptr=cupy.cuda.MemoryPointer(memory, 0))
            buffer.fill(0)
            cupy.cuda.get_current_stream().synchronize()  # zeroed before the daemon maps it
        return cls(cupy, buffer, device)

    @classmethod
    def wrap(cls, pointer: int, size_bytes: int, device: int, owner: object) -> DeviceMemory:
        """Device memory another library allocated (an engine's KV cache): `size_bytes` at
        `pointer` on GPU `device`, kept alive by `owner`.

        Raises:
            BackendUnavailableError: CuPy is not installed.
        """
        cupy = load_cupy()
        with cupy.cuda.Device(device):
            memory = cupy.cuda.UnownedMemory(pointer, size_bytes, owner, device)
            buffer = cupy.ndarray((size_bytes,), dtype=cupy.uint8,
                                  memptr=cupy.cuda.MemoryPointer(memory, 0))
        return cls(cupy, buffer, device)

    def pages(self, layout: PoolLayout) -> Any:
        """The buffer as the `[num_pages, num_layers, 2, segment_bytes]` device view."""
        return device_view(load_cupy(), self.buffer, layout)
