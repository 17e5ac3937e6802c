"""Early writeback: ask the kernel to start writing a file range to the device now.

A buffered write only fills the page cache; the device starts writing at the next fdatasync (or
when the kernel's flusher gets to it). `start_writeback` starts it at once with Linux's
`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which returns without waiting, so the device writes one
run of pages while the caller copies the next. It is a hint: durability still comes from
fdatasync, and where the call is missing (not Linux) or fails it does nothing.
Verbs: `start_writeback`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages not yet under writeback


def _load_sync_file_range() -> Callable[..., int] | None:
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, num_bytes: int) -> None:
    """Start writing `num_bytes` at `offset` of `fd` to the device; do not wait for it.

    ctypes releases the GIL for the call. Errors are ignored: the caller's fdatasync reports them.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, num_bytes, _SYNC_FILE_RANGE_WRITE)
