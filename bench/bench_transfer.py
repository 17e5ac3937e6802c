"""Transfer engine throughput: batching, full duplex and each lane beside a plain copy.

Run:

    python bench/bench_transfer.py [--json] [--backend cpu|cuda] [--pages 64] [--repeats 5]
        [--dma-run-bytes N] [--lane-blocks N] [--staging-mib N] [--staging-buffers N]

Pages of a 32-layer, 8-KV-head, 128-dim bf16 model, 16 tokens each (32 KiB per K or V segment,
2 MiB per page), in a layer-first (vLLM) pool, mapped to seeded random arena slots.

- `batch_speedup`: naive (one np.copyto per page per layer K+V pair, one direction at a time,
  waiting on each) time / one batched store job of the same pages.
- `duplex_ratio`: a store job then a recall job, one after the other / both submitted together.
- `lane_ratio`: each lane's GB/s / one contiguous copy of the same bytes (the machine's limit,
  measured in the same run; on CUDA a pinned cudaMemcpyAsync of one buffer each way).
- CUDA only, `hbm_ratio`: recalls of the same pages from a device arena (the hbm tier: scatter
  kernels, device to device) GB/s / one device-to-device cudaMemcpyAsync of the same bytes. The
  naive baseline of `batch_speedup` is then one cudaMemcpyAsync per K or V segment into the
  (pinned) arena, synchronized after each.

Warm-up excluded; medians and p99 over `--repeats`; GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvtier.pools.layout import PoolLayout
from kvtier.transfer import CpuBackend, DuplexLanes, PoolMemory, PoolPageIds

LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 32, 8, 128, 16


def timed(run: Callable[[], None], repeats: int) -> tuple[float, float]:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dma-run-bytes", type=int, default=None,
                        help="CUDA: arena runs at least this long go by DMA (default: the "
                             "backend's; 0 always DMA, a huge value never)")
    parser.add_argument("--lane-blocks", type=int, default=None,
                        help="CUDA: most thread blocks per lane kernel (default: the backend's)")
    parser.add_argument("--staging-mib", type=int, default=None,
                        help="CUDA: MiB per staging buffer (default: the backend's)")
    parser.add_argument("--staging-buffers", type=int, default=None,
                        help="CUDA: staging buffers per lane (default: the backend's)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    num_pages = args.pages
    layout = PoolLayout.layer_first(2 * num_pages, LAYERS, PAGE_TOKENS, HEADS, HEAD_DIM,
                                    "bfloat16")
    page_bytes = layout.page_bytes
    total = num_pages * page_bytes
    host_data = rng.integers(0, 256, layout.span_bytes, dtype=np.uint8)
    arena = np.zeros(2 * total, np.uint8)
    arena[:] = 1  # pre-fault
    if args.backend == "cuda":
        import cupy

        from kvtier.transfer.cuda import CudaBackend

        tuning = {name: value for name, value in (
            ("dma_run_bytes", args.dma_run_bytes), ("lane_blocks", args.lane_blocks),
            ("staging_bytes", args.staging_mib and args.staging_mib << 20),
            ("num_staging_buffers", args.staging_buffers)) if value is not None}
        backend = CudaBackend(**tuning)
        pool = PoolMemory(layout, cupy.asarray(host_data))
    else:
        backend = CpuBackend()
        pool = PoolMemory(layout, host_data)
    store_pages = rng.permutation(num_pages)
    recall_pages = num_pages + rng.permutation(num_pages)
    store_slots = rng.permutation(num_pages) * page_bytes
    recall_slots = total + rng.permutation(num_pages) * page_bytes
    keys = [i.to_bytes(16, "little") for i in range(num_pages)]
    engine = DuplexLanes(backend, arena)
    if args.backend == "cuda" and not backend.wait_until_pinned(60):
        raise SystemExit("bench_transfer: the host arena was not pinned within 60 s")

    def store() -> None:
        engine.submit_store(PoolPageIds(pool, store_pages), store_slots, keys).result()

    def recall() -> None:
        engine.submit_recall(PoolPageIds(pool, recall_pages), recall_slots, keys).result()

    def serial() -> None:
        store()
        recall()

    def duplex() -> None:
        jobs = [engine.submit_store(PoolPageIds(pool, store_pages), store_slots, keys),
                engine.submit_recall(PoolPageIds(pool, recall_pages), recall_slots, keys)]
        for job in jobs:
            job.result()

    results: dict[str, object] = {"backend": args.backend, "pages": num_pages,
                                  "page_bytes": page_bytes, "total_bytes": total}
    if args.backend == "cuda":
        results.update(dma_run_bytes=backend.dma_run_bytes, lane_blocks=backend.lane_blocks,
                       staging_bytes=backend.staging_bytes,
                       staging_buffers=backend.num_staging_buffers)
    store_s, store_p99 = timed(store, args.repeats)
    recall_s, recall_p99 = timed(recall, args.repeats)
    serial_s, _ = timed(serial, args.repeats)
    duplex_s, duplex_p99 = timed(duplex, args.repeats)
    if args.backend == "cpu":
        view = layout.page_view(host_data)
        segment = layout.segment_bytes

        def naive() -> None:
            for page, slot in zip(store_pages.tolist(), store_slots.tolist()):
                for layer in range(LAYERS):
                    np.copyto(arena[slot + layer * 2 * segment : slot + (layer + 1) * 2 * segment]
                              .reshape(2, segment), view[page, layer])

        naive_s, _ = timed(naive, args.repeats)
        source = np.ones(total, np.uint8)
        limit_s, _ = timed(lambda: np.copyto(arena[:total], source), args.repeats)
        limit_h2d_s = limit_d2h_s = limit_s
        results["batch_speedup"] = naive_s / store_s
    else:
        import cupy

        pinned = cupy.cuda.alloc_pinned_memory(total)
        device = cupy.empty(total, cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)

        def plain(kind: int) -> Callable[[], None]:
            def run() -> None:
                if kind == 2:
                    cupy.cuda.runtime.memcpyAsync(pinned.ptr, device.data.ptr, total, 2,
                                                  stream.ptr)
                else:
                    cupy.cuda.runtime.memcpyAsync(device.data.ptr, pinned.ptr, total, 1,
                                                  stream.ptr)
                stream.synchronize()
            return run

        limit_d2h_s, _ = timed(plain(2), args.repeats)
        limit_h2d_s, _ = timed(plain(1), args.repeats)
        segment = layout.segment_bytes
        pool_address = int(pool.base.data.ptr)

        def naive() -> None:
            arena_address = arena.ctypes.data
            for page, slot in zip(store_pages.tolist(), store_slots.tolist()):
                for layer in range(LAYERS):
                    for kv in range(2):
                        source = (pool_address + page * layout.page_stride_bytes
                                  + layer * layout.layer_stride_bytes + kv * layout.kv_stride_bytes)
                        cupy.cuda.runtime.memcpyAsync(
                            arena_address + slot + (2 * layer + kv) * segment, source, segment,
                            2, stream.ptr)
                        stream.synchronize()

        naive_s, _ = timed(naive, max(1, args.repeats // 2))
        results["batch_speedup"] = naive_s / store_s
        hbm = cupy.empty(total, cupy.uint8)
        hbm_engine = DuplexLanes(CudaBackend(num_staging_buffers=1, staging_bytes=1 << 20,
                                                device_arena_address=int(hbm.data.ptr)), hbm)
        hbm_slots = rng.permutation(num_pages) * page_bytes

        def recall_from_hbm() -> None:
            hbm_engine.submit_recall(PoolPageIds(pool, recall_pages), hbm_slots, keys).result()

        def plain_d2d() -> None:
            cupy.cuda.runtime.memcpyAsync(hbm.data.ptr, device.data.ptr, total, 3, stream.ptr)
            stream.synchronize()

        d2d_s, _ = timed(recall_from_hbm, args.repeats)
        limit_d2d_s, _ = timed(plain_d2d, args.repeats)
        hbm_engine.close()
        results.update({"d2d_gbps": total / d2d_s / 1e9,
                        "plain_d2d_gbps": total / limit_d2d_s / 1e9,
                        "hbm_ratio": limit_d2d_s / d2d_s})
    gbps = lambda s, n=total: n / s / 1e9  # noqa: E731
    results.update({
        "d2h_gbps": gbps(store_s), "d2h_p99_s": store_p99,
        "h2d_gbps": gbps(recall_s), "h2d_p99_s": recall_p99,
        "duplex_gbps": gbps(duplex_s, 2 * total), "duplex_p99_s": duplex_p99,
        "plain_d2h_gbps": gbps(limit_d2h_s), "plain_h2d_gbps": gbps(limit_h2d_s),
        "duplex_ratio": serial_s / duplex_s,
        "lane_ratio_d2h": limit_d2h_s / store_s, "lane_ratio_h2d": limit_h2d_s / recall_s,
        "duplex_vs_one_lane": gbps(duplex_s, 2 * total) / max(gbps(store_s), gbps(recall_s)),
    })
    engine.close()
    if args.json:
        print(json.dumps(results))
    else:
        for name, value in results.items():
            print(f"{name:>20}: {value:.3f}" if isinstance(value, float) else
                  f"{name:>20}: {value}")


if __name__ == "__main__":
    main()
