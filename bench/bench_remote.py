"""Recall from the remote tier (Redis) beside a raw GET loop of the same bytes, same client, same
run.

Run:

    python bench/bench_remote.py [--json] [--repeats 5] [--total 64MiB] [--url redis://...]

Without `--url` it starts its own `redis-server` on loopback (Debian's package) in a temporary
directory and kills it at the end. For each page size (64 KiB and 2 MiB), `--total` bytes of
pages are written to the remote by one store ("node a", write-through), then read back two ways,
interleaved in each repetition:

- raw: `GET` of each page's Redis key in a loop, awaited one by one, on the remote tier's own
  redis-py client and event loop: the simplest correct way to read the same bytes.
- kvtier: `PageStore.recall` of the same keys on a second store ("node b", empty local tiers):
  one batched round trip, header and xxh3 checksum verified for every page, pages stored in node
  b's host tier and copied into the caller's buffers. The keys are deleted from node b after each
  repetition so every recall misses locally.

`remote_recall_ratio` = kvtier GB/s / raw GB/s (median repetition), target >= 0.8. Recalled bytes
are checked against what was stored once, outside timing. `--json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.config import DiskConfig, HostConfig, RemoteConfig, StoreConfig
from kvtier.keys import Namespace
from kvtier.sizes import parse_bytes
from kvtier.store.page_store import PageStore
from kvtier.testing.redis import REDIS_SERVER, RedisServer
from kvtier.tuning import reexec_tuned

PAGE_SIZES = {"64k": 64 << 10, "2m": 2 << 20}


def make_node(url: str, host_bytes: int, page_bytes: int) -> PageStore:
    return PageStore(StoreConfig(
        host=HostConfig(capacity_bytes=host_bytes, chunk_bytes=max(page_bytes, 1 << 20)),
        disk=DiskConfig(enabled=False), remote=RemoteConfig(url=url, timeout_s=5.0)))


def raw_get_loop(node: PageStore, names: list[str]) -> float:
    """Seconds for one awaited GET per key on the tier's own client and loop."""
    remote = node.remote

    async def loop() -> float:
        client = remote._client
        started = time.perf_counter()
        for name in names:
            value = await client.get(name)
            assert value is not None
        return time.perf_counter() - started

    return asyncio.run_coroutine_threadsafe(loop(), remote._loop).result(600)


def bench_page_size(url: str, label: str, page_bytes: int, total_bytes: int,
                    repeats: int, log) -> dict:
    num_pages = max(1, total_bytes // page_bytes)
    namespace = Namespace(f"bench-remote-{label}", "bfloat16", "page-first", 16, page_bytes)
    rng = np.random.default_rng(0)
    keys = [rng.bytes(16) for _ in range(num_pages)]
    data = rng.integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)
    host_bytes = (num_pages + 4) * page_bytes
    with make_node(url, host_bytes, page_bytes) as writer, \
            make_node(url, host_bytes, page_bytes) as reader:
        assert writer.store(namespace, keys, data).ok
        assert writer.remote.drain(120), "the writes did not reach the remote"
        names = [reader.remote.name_of(namespace.fingerprint + key) for key in keys]
        out = np.zeros_like(data)
        raw_s, ours_s, promoted_s = [], [], []
        for rep in range(repeats + 1):  # the first round warms both paths
            raw = raw_get_loop(reader, names)
            started = time.perf_counter()
            result = reader.recall(namespace, keys, out)
            ours = time.perf_counter() - started
            reader._remote_link.wait_promotions()
            promoted = time.perf_counter() - started
            assert result.ok, result.failed or result.missing[:3]
            if rep == 0:
                assert np.array_equal(out, data), "recalled bytes differ from what was stored"
            else:
                raw_s.append(raw)
                ours_s.append(ours)
                promoted_s.append(promoted)
            reader.delete(namespace, keys)
            log(f"{label} rep {rep}: raw GET loop {raw * 1e3:.1f} ms, kvtier recall "
                f"{ours * 1e3:.1f} ms ({promoted * 1e3:.1f} ms until promoted into host)")
    raw_gbps = num_pages * page_bytes / statistics.median(raw_s) / 1e9
    ours_gbps = num_pages * page_bytes / statistics.median(ours_s) / 1e9
    promoted_gbps = num_pages * page_bytes / statistics.median(promoted_s) / 1e9
    return {"page_bytes": page_bytes, "num_pages": num_pages,
            "raw_get_gbps": raw_gbps, "remote_recall_gbps": ours_gbps,
            "remote_recall_ratio": ours_gbps / raw_gbps,
            "recall_and_promote_ratio": promoted_gbps / raw_gbps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--total", default="64MiB", help="bytes of pages per page size")
    parser.add_argument("--url", help="an existing Redis to use (default: start one)")
    args = parser.parse_args()
    reexec_tuned()  # as the daemon runs (kvtier/tuning.py)
    log = (lambda text: print(text, file=sys.stderr)) if args.json else print
    server = None
    if args.url is None:
        if REDIS_SERVER is None:
            sys.exit("redis-server is not installed (apt-get install redis-server), or pass --url")
        server = RedisServer(Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-")))
        server.start()
    url = args.url or server.url
    try:
        results = {label: bench_page_size(url, label, size, parse_bytes(args.total),
                                          args.repeats, log)
                   for label, size in PAGE_SIZES.items()}
    finally:
        if server is not None:
            server.stop()
    figures = {"redis_server": "started by the bench" if server else url, "page_sizes": results,
               "remote_recall_ratio_min": min(r["remote_recall_ratio"] for r in results.values())}
    if args.json:
        print(json.dumps(figures))
        return
    for label, r in results.items():
        print(f"{label:>4}: kvtier recall {r['remote_recall_gbps']:.2f} GB/s, raw GET loop "
              f"{r['raw_get_gbps']:.2f} GB/s, ratio {r['remote_recall_ratio']:.2f} "
              f"(target >= 0.8); "
              f"until also promoted into host: {r['recall_and_promote_ratio']:.2f}")


if __name__ == "__main__":
    main()
