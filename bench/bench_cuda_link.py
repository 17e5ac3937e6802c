"""The host link's limits on a GPU machine, and what each CUDA copy path of the lanes reaches.

Run (GPU machine, CuPy):

    python bench/bench_cuda_link.py [--mib 512] [--json]

Prints GB/s (1e9 bytes/s), medians of 5 after a warm-up:
- `plain_*`: one cudaMemcpyAsync of the whole buffer between device and pinned host memory, each
  direction alone and both at once on two streams (`plain_duplex_ratio`: both / one): what the
  link gives, and the ceiling of `bench_transfer.py`'s duplex figure.
- `dma_2mib_*`: the same bytes as 2 MiB copies into a `cudaHostRegister`ed numpy arena (the
  lanes' DMA path, one call per arena run), alone and both directions at once.
- `kernel_<blocks>_*`: the gather/scatter kernels over 32 KiB segments reading or writing the
  mapped arena (the lanes' zero-copy path), for several grid sizes, alone and both at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

SEGMENT = 32 << 10
RUN = 2 << 20


def median_s(run: Callable[[], None], repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import cupy

    from kvtier.transfer.cuda import REGISTER_PORTABLE_MAPPED, CudaBackend

    runtime = cupy.cuda.runtime
    total = args.mib << 20
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    device = [cupy.zeros(total, cupy.uint8) for _ in range(2)]
    pinned = [cupy.cuda.alloc_pinned_memory(total) for _ in range(2)]
    arena = np.zeros(2 * total + 4096, np.uint8)
    base = -arena.ctypes.data % 4096
    arena = arena[base : base + 2 * total]
    runtime.hostRegister(arena.ctypes.data, arena.nbytes, REGISTER_PORTABLE_MAPPED)
    halves = [arena.ctypes.data, arena.ctypes.data + total]
    results: dict[str, float] = {}

    def both(*steps: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for step in steps:
                step()
            for stream in streams:
                stream.synchronize()
        return run

    def plain(lane: int, kind: int) -> Callable[[], None]:
        def step() -> None:
            dst, src = ((pinned[lane].ptr, device[lane].data.ptr) if kind == 2
                        else (device[lane].data.ptr, pinned[lane].ptr))
            runtime.memcpyAsync(dst, src, total, kind, streams[lane].ptr)
        return step

    def dma(lane: int, kind: int) -> Callable[[], None]:
        def step() -> None:
            for at in range(0, total, RUN):
                host, dev = halves[lane] + at, device[lane].data.ptr + at
                dst, src = (host, dev) if kind == 2 else (dev, host)
                runtime.memcpyAsync(dst, src, RUN, kind, streams[lane].ptr)
        return step

    gbps = lambda s, n=total: n / s / 1e9  # noqa: E731
    for name, make in (("plain", plain), ("dma_2mib", dma)):
        d2h, h2d = gbps(median_s(both(make(0, 2)))), gbps(median_s(both(make(1, 1))))
        duplex = gbps(median_s(both(make(0, 2), make(1, 1))), 2 * total)
        results.update({f"{name}_d2h": d2h, f"{name}_h2d": h2d, f"{name}_both": duplex,
                        f"{name}_duplex_ratio": duplex / max(d2h, h2d)})
    count = total // SEGMENT
    order = np.random.default_rng(0).permutation(count).astype(np.uint64)
    tables = []
    for lane in range(2):
        pool = np.uint64(device[lane].data.ptr) + order * np.uint64(SEGMENT)
        offsets = np.arange(count, dtype=np.uint64) * np.uint64(SEGMENT) + np.uint64(lane * total)
        tables.append((cupy.asarray(pool), cupy.asarray(offsets),
                       cupy.full(count, SEGMENT, dtype=cupy.uint64)))
    backend = CudaBackend(pin_arena=False)
    for blocks in (132, 264, 528, 1056, 8192):
        def kernel(lane: int, blocks: int = blocks) -> Callable[[], None]:
            pool, offsets, lengths = tables[lane]
            address = np.uint64(arena.ctypes.data)

            def step() -> None:
                if lane == 0:  # store: pool -> mapped arena
                    backend.gather((blocks,), (256,), (pool, offsets, lengths, np.uint64(count),
                                                       address), stream=streams[0])
                else:  # recall: mapped arena -> pool
                    backend.scatter((blocks,), (256,), (address, offsets, lengths,
                                                        np.uint64(count), pool), stream=streams[1])
            return step

        d2h, h2d = gbps(median_s(both(kernel(0)))), gbps(median_s(both(kernel(1))))
        duplex = gbps(median_s(both(kernel(0), kernel(1))), 2 * total)
        results.update({f"kernel_{blocks}_d2h": d2h, f"kernel_{blocks}_h2d": h2d,
                        f"kernel_{blocks}_both": duplex})
    runtime.hostUnregister(arena.ctypes.data)
    if args.json:
        print(json.dumps(results))
    else:
        for name, value in results.items():
            print(f"{name:>24}: {value:8.2f}")


if __name__ == "__main__":
    main()
