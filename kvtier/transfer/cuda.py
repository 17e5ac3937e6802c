"""The CUDA backend: gather/scatter kernels and DMA on one stream per lane, through CuPy.

CuPy is imported only when a `CudaBackend` is built, so nothing on the CPU path needs it.

Store (d2h), staged: per staging buffer, one `gather_segments` launch packs the pool's fragmented
K/V segments into device staging, one `cudaMemcpyAsync` moves it to pinned host staging, an event
marks it; once the event passed, the host copies pinned staging into the arena slots (overlapping
the device work on the next buffers). Recall (h2d) is the mirror: host copy into pinned staging,
DMA, `scatter_segments`. Once the arena is pinned and mapped (`cudaHostRegister` in chunks on a
background thread, off the start-up path), no host copy is left: where the tick's arena runs are
long (whole pages in their slots), a kernel packs device staging and the copy engine moves each
run between staging and the arena (`cudaMemcpyAsync`: the copy engines reach the link's limit and
run both directions at once); where runs are short, one kernel reads or writes the arena itself.
Each lane's kernels use at most a quarter of the GPU's resident blocks, so a store's and a
recall's kernels run side by side. Verbs: `CudaBackend.attach_arena`, `open_mover`, `close`.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from kvtier.cuda import kernel_source
from kvtier.errors import ProtocolError
from kvtier.pools.layout import PoolMemory
from kvtier.transfer.jobs import Direction, LaneJob
from kvtier.transfer.segments import (
    SegmentPlan,
    cap_lengths,
    cut_runs_at,
    plan_segments,
    split_chunks,
)
from kvtier.transfer.staging import StagingRing

log = logging.getLogger(__name__)

THREADS_PER_BLOCK = 256  # 256 x 16-byte vectors: a 32 KiB segment in 8 strides per block
MAX_BLOCKS = 8192  # kernels loop over segments by grid stride beyond this
RESIDENT_THREADS_PER_SM = 2048  # every CUDA GPU since Maxwell
# A pinned arena's runs at least this long on average go by the copy engine, shorter ones by a
# kernel on mapped memory: one cudaMemcpyAsync call costs a few microseconds of Python, which a
# 512 KiB run (about 10 us on PCIe 5) hides.
DMA_RUN_BYTES = 512 << 10
# One thread block copies one segment: merged runs (page-first pools into adjacent slots) are cut
# to this so a large batch spreads over the GPU's SMs instead of running on one.
BLOCK_SEGMENT_BYTES = 256 << 10
REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
ATTR_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEVICE_TO_HOST = 2
KERNEL_OPTIONS = ("--std=c++17",)  # NVRTC's, through CuPy's RawModule
POOL, ARENA, LENGTH, STAGED = range(4)  # rows of a tick's segment tables on the device


@dataclass(slots=True)
class _Staging:
    # CuPy ships no type annotations: its objects are Any here.
    device: Any  # cupy uint8 array
    host: np.ndarray  # view of pinned memory
    host_memory: Any  # cupy PinnedMemoryPointer, kept alive
    event: Any  # cupy.cuda.Event recorded after the buffer's last use
    handoff: Any  # cupy.cuda.Event: the DMA path's kernel/copy hand-over between the streams


def pool_address(pool: PoolMemory) -> int:
    """The device address of a pool's first byte."""
    base = pool.base
    if isinstance(base, (int, np.integer)):
        return int(base)
    device_array: Any = base  # a CuPy array (untyped), as `check_pool` admitted it
    return int(device_array.data.ptr)


def _mean_run_bytes(plan: SegmentPlan) -> float:
    """Bytes per arena-contiguous run of a tick's segments (0 for an empty tick)."""
    if not len(plan.lengths):
        return 0.0
    offsets, lengths = plan.arena_offsets.astype(np.int64), plan.lengths.astype(np.int64)
    breaks = int(np.count_nonzero(offsets[1:] != offsets[:-1] + lengths[:-1]))
    return float(lengths.sum()) / (breaks + 1)


def _arena_runs(offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """(staging offset, arena offset, length) runs: segments contiguous in the arena merged."""
    staged = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    offsets = offsets.astype(np.int64)
    lengths = lengths.astype(np.int64)
    joins = offsets[1:] == offsets[:-1] + lengths[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return staged[starts], offsets[starts], np.add.reduceat(lengths, starts)


class CudaMover:
    """One lane's stream, staging ring and kernel launches."""

    def __init__(self, backend: CudaBackend, direction: Direction, arena: np.ndarray) -> None:
        cp = backend.cupy
        self.backend = backend
        self.direction = direction
        self.arena = arena
        with backend.device():
            self.stream = cp.cuda.Stream(non_blocking=True)
            # The DMA path's copies run here, so a chunk's kernel overlaps the copy before it.
            self.copy_stream = cp.cuda.Stream(non_blocking=True)
            buffers = []
            for _ in range(backend.num_staging_buffers):
                memory = cp.cuda.alloc_pinned_memory(backend.staging_bytes)
                buffers.append(_Staging(
                    cp.empty(backend.staging_bytes, dtype=cp.uint8),
                    np.frombuffer(memory, dtype=np.uint8, count=backend.staging_bytes),
                    memory, cp.cuda.Event(disable_timing=True),
                    cp.cuda.Event(disable_timing=True)))
        self.ring: StagingRing[_Staging] = StagingRing(buffers)
        self._tick_tables: list[Any] = []
        # Recorded on the legacy default stream at each tick: work queued there in this process
        # (CuPy's uploads and fills, the hbm tier's promotions) lands before the lane copies.
        self._default_stream_done = cp.cuda.Event(disable_timing=True)

    def is_device_ready(self, ready: object) -> bool:
        """A CuPy event: the stream waits on it, the host does not."""
        return isinstance(ready, self.backend.cupy.cuda.Event)

    def move(self, jobs: list[LaneJob]) -> None:
        """Move the batch on this lane's stream; finish each job once its bytes landed."""
        failed: dict[int, set[int]] = {}
        reasons: dict[int, str] = {}
        with self.backend.device(), self.stream:
            self._default_stream_done.record(self.backend.cupy.cuda.Stream.null)
            self.stream.wait_event(self._default_stream_done)
            for job in jobs:
                if self.is_device_ready(job.ready):
                    self.stream.wait_event(job.ready)
            plan = cap_lengths(
                plan_segments(jobs, {id(job.pool): pool_address(job.pool) for job in jobs}),
                min(BLOCK_SEGMENT_BYTES, self.backend.staging_bytes))
            arena_address = self.backend.arena_device_address
            step: Callable[[Any, SegmentPlan, int, int], None]
            if arena_address is not None and self.backend.pin_arena and _mean_run_bytes(
                    plan) >= self.backend.dma_run_bytes:
                chunks = split_chunks(plan.lengths, self.backend.staging_bytes)
                step = partial(self._move_dma, arena_address)
            elif arena_address is not None:
                chunks = [(0, len(plan.lengths))] if len(plan.lengths) else []
                step = partial(self._move_direct, arena_address)
            else:
                chunks = split_chunks(plan.lengths, self.backend.staging_bytes)
                step = self._move_staged
            try:
                tables = self._upload_tables(plan, chunks)
            except Exception as exc:  # nothing moved: every page of the tick is named
                tables = None
                for start, stop in chunks:
                    self._fail(plan, start, stop, f"{type(exc).__name__}: {exc}", failed,
                               reasons)
            for start, stop in chunks if tables is not None else ():
                try:
                    step(tables, plan, start, stop)
                except Exception as exc:  # named per page below: the chunk's pages did not move
                    self._fail(plan, start, stop, f"{type(exc).__name__}: {exc}", failed,
                               reasons)
            try:
                try:
                    self.ring.drain()  # stores: host copies out of pinned staging run here
                finally:  # nothing of this tick may still run when the next one starts
                    self.copy_stream.synchronize()
                    self.stream.synchronize()
            except Exception as exc:
                if chunks:
                    self._fail(plan, 0, len(plan.lengths), f"{type(exc).__name__}: {exc}",
                               failed, reasons)
        self._tick_tables.clear()
        for job in jobs:
            job.finish(sorted(failed.get(id(job), ())), reasons.get(id(job), ""))

    @staticmethod
    def _fail(plan: SegmentPlan, start: int, stop: int, reason: str,
              failed: dict[int, set[int]], reasons: dict[int, str]) -> None:
        first, last = int(plan.entries[start]), int(plan.last_entries[stop - 1])
        for job, index in plan.owners[first : last + 1]:
            failed.setdefault(id(job), set()).add(index)
            reasons.setdefault(id(job), reason)

    def _upload_tables(self, plan: SegmentPlan, chunks: list[tuple[int, int]]) -> Any:
        """The tick's segment tables in one upload on this stream, rows POOL, ARENA, LENGTH and
        STAGED (each segment's offset in its chunk's staging buffer); chunks use slices of them.
        Kept alive until the tick's synchronize (CuPy's pool reuses memory stream-ordered)."""
        lengths = plan.lengths.astype(np.uint64)
        staged = np.cumsum(lengths) - lengths
        if len(chunks) > 1:  # restart at 0 in each chunk
            starts = np.array([start for start, _ in chunks], dtype=np.int64)
            sizes = np.diff(np.append(starts, len(lengths)))
            staged -= np.repeat(staged[starts], sizes)
        host = np.stack([plan.pool_addrs, plan.arena_offsets, lengths, staged]).astype(np.uint64)
        tables = self.backend.cupy.asarray(host)
        self._tick_tables.append(tables)
        return tables

    def _launch(self, kernel: Any, num_segments: int, args: tuple[Any, ...],
                max_blocks: int | None = None) -> None:
        """`max_blocks`: a short kernel within device memory may take every block; one on the
        mapped arena keeps to the lane's share."""
        grid = (min(num_segments, max_blocks or self.backend.lane_blocks),)
        kernel(grid, (THREADS_PER_BLOCK,), args, stream=self.stream)

    def _move_direct(self, arena_address: int, tables: Any, plan: SegmentPlan, start: int,
                     stop: int) -> None:
        """Pinned, mapped arena: one kernel reads or writes the arena itself."""
        pool_addrs, arena_offsets, lengths = (tables[row, start:stop]
                                              for row in (POOL, ARENA, LENGTH))
        count = np.uint64(stop - start)
        if self.direction is Direction.D2H:
            self._launch(self.backend.gather, stop - start,
                         (pool_addrs, arena_offsets, lengths, count, np.uint64(arena_address)))
        else:
            self._launch(self.backend.scatter, stop - start,
                         (np.uint64(arena_address), arena_offsets, lengths, count, pool_addrs))

    def _move_dma(self, arena_address: int, tables: Any, plan: SegmentPlan, start: int,
                  stop: int) -> None:
        """Pinned arena, long runs: gather into device staging, then one copy-engine DMA per arena
        run (or the mirror for a recall); nothing is copied on the host."""
        runtime = self.backend.cupy.cuda.runtime
        lengths = plan.lengths[start:stop]
        index, buffer = self.ring.acquire()
        pool_addrs, staged_offsets, device_lengths = (tables[row, start:stop]
                                                      for row in (POOL, STAGED, LENGTH))
        count = np.uint64(stop - start)
        staging = buffer.device.data.ptr
        runs = zip(*(r.tolist() for r in cut_runs_at(
            *_arena_runs(plan.arena_offsets[start:stop], lengths), self.backend.register_bounds)))
        # Kernels on `stream` (ordered after the jobs' ready events), copies on `copy_stream`:
        # the gather of one chunk runs while the copy engine still moves the chunk before it.
        if self.direction is Direction.D2H:
            self._launch(self.backend.gather, stop - start,
                         (pool_addrs, staged_offsets, device_lengths, count, buffer.device),
                         MAX_BLOCKS)
            buffer.handoff.record(self.stream)
            self.copy_stream.wait_event(buffer.handoff)
            for staged_at, arena_at, length in runs:
                runtime.memcpyAsync(arena_address + arena_at, staging + staged_at, length,
                                    MEMCPY_DEVICE_TO_HOST, self.copy_stream.ptr)
            buffer.event.record(self.copy_stream)
        else:
            for staged_at, arena_at, length in runs:
                runtime.memcpyAsync(staging + staged_at, arena_address + arena_at, length,
                                    MEMCPY_HOST_TO_DEVICE, self.copy_stream.ptr)
            buffer.handoff.record(self.copy_stream)
            self.stream.wait_event(buffer.handoff)
            self._launch(self.backend.scatter, stop - start,
                         (buffer.device, staged_offsets, device_lengths, count, pool_addrs),
                         MAX_BLOCKS)
            buffer.event.record(self.stream)
        self.ring.release(index, buffer.event)

    def _move_staged(self, tables: Any, plan: SegmentPlan, start: int, stop: int) -> None:
        """One staging buffer: gather + DMA (+ host copy later), or host copy + DMA + scatter."""
        runtime = self.backend.cupy.cuda.runtime
        lengths = plan.lengths[start:stop]
        num_bytes = int(lengths.sum())
        index, buffer = self.ring.acquire()
        pool_addrs, staged_offsets, device_lengths = (tables[row, start:stop]
                                                      for row in (POOL, STAGED, LENGTH))
        count = np.uint64(stop - start)
        runs = _arena_runs(plan.arena_offsets[start:stop], lengths)
        if self.direction is Direction.D2H:
            self._launch(self.backend.gather, stop - start,
                         (pool_addrs, staged_offsets, device_lengths, count, buffer.device))
            runtime.memcpyAsync(buffer.host.ctypes.data, buffer.device.data.ptr, num_bytes,
                                MEMCPY_DEVICE_TO_HOST, self.stream.ptr)
            buffer.event.record(self.stream)
            self.ring.release(index, buffer.event, partial(self._unstage, buffer.host, runs))
        else:
            for staged_at, arena_at, length in zip(*(r.tolist() for r in runs)):
                buffer.host[staged_at : staged_at + length] = (
                    self.arena[arena_at : arena_at + length])
            runtime.memcpyAsync(buffer.device.data.ptr, buffer.host.ctypes.data, num_bytes,
                                MEMCPY_HOST_TO_DEVICE, self.stream.ptr)
            self._launch(self.backend.scatter, stop - start,
                         (buffer.device, staged_offsets, device_lengths, count, pool_addrs))
            buffer.event.record(self.stream)
            self.ring.release(index, buffer.event)

    def _unstage(self, host: np.ndarray, runs: tuple[np.ndarray, ...]) -> None:
        """After the DMA landed: pinned staging -> arena slots, one copy per contiguous run."""
        for staged_at, arena_at, length in zip(*(r.tolist() for r in runs)):
            self.arena[arena_at : arena_at + length] = host[staged_at : staged_at + length]

    def close(self) -> None:
        """Wait for anything in flight; buffers go with the mover."""
        try:
            self.ring.drain()
        finally:
            self.copy_stream.synchronize()
            self.stream.synchronize()


class CudaBackend:
    """Kernels compiled once from kvtier/cuda/page_copy.cu; pinned staging per lane; a pinned arena.

    Args:
        device_id: the GPU the pools live on.
        num_staging_buffers: staging buffers per lane (pinned host + device, same size).
        staging_bytes: size of each staging buffer.
        pin_arena: register the host arena (mapped) so kernels reach it with no staging.
        register_chunk_bytes: the arena is registered this many bytes at a time, in the background.
        device_arena_address: the arena is device memory at this address (the hbm tier): kernels
            copy device to device, nothing is pinned or staged.
        dma_run_bytes: once the arena is pinned, a tick whose arena runs average at least this
            many bytes moves by copy-engine DMA through device staging; shorter runs by a kernel
            on the mapped arena.
        lane_blocks: most thread blocks one lane's kernel launches (None: a quarter of the GPU's
            resident blocks for a host arena, so both lanes' kernels run at once; all of them
            for an arena in device memory).

    Raises:
        ImportError: CuPy is not installed.
    """

    name = "cuda"

    def __init__(self, device_id: int = 0, num_staging_buffers: int = 4,
                 staging_bytes: int = 32 << 20, pin_arena: bool = True,
                 register_chunk_bytes: int = 1 << 30,
                 device_arena_address: int | None = None,
                 dma_run_bytes: int = DMA_RUN_BYTES, lane_blocks: int | None = None) -> None:
        import cupy  # lazily: only the CUDA backend needs CuPy

        self.cupy: Any = cupy  # untyped: CuPy ships no annotations
        self.device_id = device_id
        self.num_staging_buffers = num_staging_buffers
        self.staging_bytes = staging_bytes
        self.pin_arena = pin_arena and device_arena_address is None
        self.register_chunk_bytes = register_chunk_bytes
        self.dma_run_bytes = dma_run_bytes
        # Set once the whole arena is mapped; at once for an arena in device memory.
        self.arena_device_address: int | None = device_arena_address
        self.arena_pinned = threading.Event()
        self.pin_error: Exception | None = None  # what stopped the pinning; staging serves on
        self._pinning_ended = threading.Event()
        self._registered: list[int] = []
        # Arena offsets where one host registration ends and the next begins, sorted.
        self.register_bounds = np.empty(0, dtype=np.int64)
        self._pinning: threading.Thread | None = None
        self._closing = False
        with self.device():
            resident_blocks = (cupy.cuda.runtime.getDeviceProperties(device_id)
                               ["multiProcessorCount"] * RESIDENT_THREADS_PER_SM
                               // THREADS_PER_BLOCK)
            if lane_blocks is None:  # a quarter: both lanes' kernels on an H200 moved 78 GB/s
                # together, 73 at half and 53 with every block (bench/bench_cuda_link.py)
                lane_blocks = resident_blocks if device_arena_address is not None else max(
                    1, resident_blocks // 4)
            self.lane_blocks = max(1, min(lane_blocks, MAX_BLOCKS))
            module = cupy.RawModule(code=kernel_source("page_copy.cu"), options=KERNEL_OPTIONS)
            self.gather = module.get_function("gather_segments")
            self.scatter = module.get_function("scatter_segments")

    def device(self) -> AbstractContextManager[Any]:
        """A context that makes this backend's GPU current. A new `cupy.cuda.Device` each time:
        one keeps its stack of devices to restore on itself, and the lanes and the pinning
        thread enter it at once."""
        return self.cupy.cuda.Device(self.device_id)

    def check_pool(self, pool: PoolMemory) -> None:
        """Reject a pool this backend cannot address.

        Raises:
            ProtocolError: the pool base is neither a device address nor a CuPy array.
        """
        if not isinstance(pool.base, (int, np.integer)) and not hasattr(
                getattr(pool.base, "data", None), "ptr"):  # a numpy array's .data has no .ptr
            raise ProtocolError("the CUDA transfer backend needs each pool as a device address "
                                "or a CuPy array")

    def attach_arena(self, arena: np.ndarray) -> None:
        """Start pinning `arena` in the background (when `pin_arena`); staging serves meanwhile."""
        if not self.pin_arena or arena.nbytes == 0:
            self._pinning_ended.set()
            return
        self._pinning = threading.Thread(target=self._register_arena, args=(arena,),
                                         name="kvtier-pin-arena", daemon=True)
        self._pinning.start()

    def wait_until_pinned(self, timeout_s: float) -> bool:
        """Wait for the arena's pinning to end; True when kernels now reach the arena directly.

        Raises:
            Exception: the error that stopped the pinning (the lanes stage meanwhile).
        """
        self._pinning_ended.wait(timeout_s)
        if self.pin_error is not None:
            raise self.pin_error
        return self.arena_device_address is not None

    def _register_arena(self, arena: np.ndarray) -> None:
        try:
            self._register_chunks(arena)
        except Exception as exc:  # the lanes keep staging; the error is kept for the asking
            self.pin_error = exc
            log.warning("pinning the host arena failed, transfers stay staged: %s", exc)
        finally:
            self._pinning_ended.set()

    def _register_chunks(self, arena: np.ndarray) -> None:
        runtime = self.cupy.cuda.runtime
        address, end = arena.ctypes.data, arena.ctypes.data + arena.nbytes
        # Chunks end on page boundaries: the driver pins whole pages, and two registrations
        # sharing one fail (cudaErrorHostMemoryAlreadyRegistered).
        chunk_bytes = max(mmap.PAGESIZE, self.register_chunk_bytes)
        with self.device():
            start = address
            while start < end:
                if self._closing:
                    return
                stop = min(end, (start + chunk_bytes) // mmap.PAGESIZE * mmap.PAGESIZE)
                runtime.hostRegister(start, stop - start, REGISTER_PORTABLE_MAPPED)
                self._registered.append(start)
                start = stop
            self.register_bounds = np.array(self._registered[1:], dtype=np.int64) - address
            host_pointer_ok = runtime.deviceGetAttribute(ATTR_HOST_POINTER_FOR_REGISTERED_MEM,
                                                         self.device_id)
        self.arena_pinned.set()
        if host_pointer_ok:  # UVA: the mapped device address is the host address
            self.arena_device_address = address

    def open_mover(self, direction: Direction, arena: np.ndarray) -> CudaMover:
        """The mover of one lane: its own stream and staging ring."""
        return CudaMover(self, direction, arena)

    def close(self) -> None:
        """Unregister the arena (after the lanes stopped)."""
        self._closing = True
        if self._pinning is not None:
            self._pinning.join()
            self.arena_device_address = None
        runtime = self.cupy.cuda.runtime
        with self.device():
            for address in self._registered:
                runtime.hostUnregister(address)
        self._registered.clear()
