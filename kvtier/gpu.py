"""CuPy and the CUDA driver, loaded on demand by both sides of a GPU pool.

Nothing on the CPU path imports CuPy: the client's `DeviceMemory`, the daemon's `MappedDevicePool`
and the HBM tier call `load_cupy` only when a GPU pool or tier is asked for. Verbs: `load_cupy`,
`allocation_range`, `device_view`.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from kvtier.errors import BackendUnavailableError, ProtocolError
from kvtier.pools.layout import PoolLayout


def load_cupy() -> Any:
    """The `cupy` module (untyped: CuPy ships no annotations).

    Raises:
        BackendUnavailableError: CuPy is not installed.
    """
    try:
        import cupy
    except ImportError:
        raise BackendUnavailableError("this kvtier cannot use GPU pools: CuPy is not installed "
                                      "(pip install 'kvtier[cuda]')") from None
    return cupy


@functools.cache
def _cuda_driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def allocation_range(pointer: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding `pointer` (cuMemGetAddressRange, which CuPy
    does not wrap). Needs a CUDA context current on this thread: call it after a runtime call.

    Raises:
        ProtocolError: the driver does not know `pointer`.
    """
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = _cuda_driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                    ctypes.c_uint64(pointer))
    if status != 0:
        raise ProtocolError(f"the CUDA driver knows no allocation at {pointer:#x} (CUresult "
                            f"{status})")
    return base.value, size.value


def device_view(cupy: Any, base: Any, layout: PoolLayout) -> Any:
    """The pool as a `[num_pages, num_layers, 2, segment_bytes]` strided device view."""
    return cupy.lib.stride_tricks.as_strided(
        base[layout.offset_bytes :],
        shape=(layout.num_pages, layout.num_layers, 2, layout.segment_bytes),
        strides=(layout.page_stride_bytes, layout.layer_stride_bytes, layout.kv_stride_bytes, 1))
