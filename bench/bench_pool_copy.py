"""Client pool copies: a sealed memfd mapped by the daemon, and preadv/pwritev on a named pool's
descriptor, each against the mapped numpy copy.

Run:

    nice python bench/bench_pool_copy.py [--json] [--pages 64] [--repeats 9]

A client pool is a sealed memfd (kvtier/sealed_memory.py): nobody can shrink it, so the daemon
maps it (kvtier/pools/sealed.py) and the lanes copy with numpy, as for any mapped array. A
pool registered by /dev/shm name may shrink under the daemon, so it is copied with system calls on
its descriptor (kvtier/pools/pool_file.py) instead. This measures both. Pages of a 32-layer,
8-KV-head, 128-dim bf16 model, 16 tokens each (32 KiB per K or V segment, 2 MiB per page), in
/dev/shm pools of both layouts, moved by the CPU transfer engine into and out of a /dev/shm arena at
seeded random slots (runs of 4 adjacent).

- `sealed_gbps` / `file_gbps` / `mmap_gbps`: the lane's GB/s with the pool as a sealed memfd
  adopted as the daemon adopts one (`SealedPool.adopt`), as a `PoolFile` (a named pool), and as
  a mapped /dev/shm numpy array; same pages, same slots, same run.
- `sealed_ratio`: sealed / mmap (target >= 0.9); `ratio`: file / mmap (1.0 = the same speed).
- `memcpy_gbps`: one contiguous np.copyto of the same bytes, the machine's limit in this run;
  `pread_gbps`: one contiguous os.preadv of the same bytes from the pool file, the kernel's
  limit for reading tmpfs (what the file path can reach at best).

Warm-up excluded; medians and p99 over `--repeats`; GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvtier.pools.layout import PoolLayout
from kvtier.pools.pool_file import PoolFile
from kvtier.pools.sealed import SealedPool
from kvtier.sealed_memory import create_sealed
from kvtier.shm import SharedSegment, new_segment_name
from kvtier.transfer import CpuBackend, DuplexLanes, PoolMemory, PoolPageIds

LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 32, 8, 128, 16


def timed(run: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median and p99 seconds of `run`, after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(19)
    results = []
    for kind in ("page-first", "layer-first"):
        make = PoolLayout.page_first if kind == "page-first" else PoolLayout.layer_first
        layout = make(args.pages, LAYERS, PAGE_TOKENS, HEADS, HEAD_DIM, "bfloat16")
        page_bytes = layout.page_bytes
        pool_segment = SharedSegment.create(new_segment_name("kvtier-bench"), layout.span_bytes)
        arena_segment = SharedSegment.create(new_segment_name("kvtier-bench"),
                                             2 * args.pages * page_bytes)
        pool_file = PoolFile.open(pool_segment.name, os.getuid())
        sealed_fd = create_sealed("kvtier-bench", layout.span_bytes)
        sealed = SealedPool.adopt(os.dup(sealed_fd), "bench", os.getuid(), layout)
        assert sealed.array is not None
        try:
            pool_segment.prefault()
            arena_segment.prefault()
            pool_array = pool_segment.array()
            pool_array[:] = rng.integers(0, 256, pool_array.size, dtype=np.uint8)
            np.copyto(sealed.array, pool_array)  # and prefaulted
            arena = arena_segment.array()
            # Runs of 4 adjacent slots at random places: what a store of a few sequences sees.
            groups = rng.permutation(2 * args.pages // 4)[: args.pages // 4]
            slots = [int(g) * 4 * page_bytes + i * page_bytes for g in groups for i in range(4)]
            page_ids = list(range(args.pages))
            keys = [i.to_bytes(16, "little") for i in page_ids]
            total_bytes = args.pages * page_bytes
            scratch = np.empty(total_bytes, np.uint8)
            memcpy_s, _ = timed(lambda: np.copyto(scratch, arena[:total_bytes]), args.repeats)
            raw_fd = os.open(f"/dev/shm/{pool_segment.name}", os.O_RDONLY)
            try:
                pread_s, _ = timed(lambda: os.preadv(raw_fd, [memoryview(scratch)], 0),
                                   args.repeats)
            finally:
                os.close(raw_fd)
            row = {"layout": kind, "pages": args.pages, "page_bytes": page_bytes,
                   "memcpy_gbps": total_bytes / memcpy_s / 1e9,
                   "pread_gbps": total_bytes / pread_s / 1e9}
            with DuplexLanes(CpuBackend(), arena) as engine:
                for lane, submit in (("store", engine.submit_store),
                                     ("recall", engine.submit_recall)):
                    for path, base in (("mmap", pool_array), ("sealed", sealed.array),
                                       ("file", pool_file)):
                        pages = PoolPageIds(PoolMemory(layout, base), page_ids)
                        median_s, p99_s = timed(
                            lambda: submit(pages, slots, keys).result(), args.repeats)
                        row[f"{lane}_{path}_gbps"] = total_bytes / median_s / 1e9
                        row[f"{lane}_{path}_p99_gbps"] = total_bytes / p99_s / 1e9
                    row[f"{lane}_ratio"] = row[f"{lane}_file_gbps"] / row[f"{lane}_mmap_gbps"]
                    row[f"{lane}_sealed_ratio"] = (row[f"{lane}_sealed_gbps"]
                                                   / row[f"{lane}_mmap_gbps"])
            results.append(row)
        finally:
            pool_file.close()
            sealed.close()
            os.close(sealed_fd)
            for segment in (pool_segment, arena_segment):
                segment.close()
                segment.unlink()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'layout':<12} {'lane':<7} {'sealed':>7} {'sealed/mmap':>11} {'file GB/s':>9} "
          f"{'mmap GB/s':>9} {'file/mmap':>9} {'p99 file':>9} {'memcpy':>7} {'pread':>6}")
    for row in results:
        for lane in ("store", "recall"):
            print(f"{row['layout']:<12} {lane:<7} {row[f'{lane}_sealed_gbps']:>7.2f} "
                  f"{row[f'{lane}_sealed_ratio']:>11.2f} {row[f'{lane}_file_gbps']:>9.2f} "
                  f"{row[f'{lane}_mmap_gbps']:>9.2f} {row[f'{lane}_ratio']:>9.2f} "
                  f"{row[f'{lane}_file_p99_gbps']:>9.2f} {row['memcpy_gbps']:>7.2f} "
                  f"{row['pread_gbps']:>6.2f}")


if __name__ == "__main__":
    main()
