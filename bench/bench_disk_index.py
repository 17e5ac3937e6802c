"""The disk index's cost per page stored and removed, as the index fills.

Run:

    python bench/bench_disk_index.py [--json] [--resident 0,50000,200000] [--rounds 64]
        [--stores 0,50000] [--store-dir /dev/shm]

A write-through store indexes its pages in one LMDB transaction (`DiskIndex.add`), an eviction
removes them in another (`DiskIndex.remove`). For each size in `--resident`, a fresh index is
filled with that many records of 64 KiB pages (random keys, the slots of earlier stores), then
`--rounds` batches of 64 pages in adjacent slots, as one store places them, are added and later
removed. Beside it, in the same run, the bare LMDB `putmulti` of the same records under the
key layout of format 3 (scoped key first, then slot), on an index filled the same way:

- `add_us_<n>` / `remove_us_<n>`: median microseconds per page of `DiskIndex.add` / `remove`
  with `n` records resident;
- `key_first_add_us_<n>`: the bare `putmulti` of the same batches keyed scoped key first;
- `add_ratio_<n>`: `add_us_<n>` / `key_first_add_us_<n>` (below 1: cheaper than the format-3
  layout even before kvtier's own work); `growth_ratio`: `add_us` at the largest `n` over the
  smallest (1.0: the cost does not grow with the index).

With `--stores`, the same end to end: a write-through `PageStore.store` of 64-page batches of
64 KiB pages into a disk tier under `--store-dir` (tmpfs by default, so the device's noise is
out) already holding each number of pages (it needs that many times 64 KiB there), median of
7 rounds of 1,024 pages: `store_us_<n>`, and `store_growth_ratio`, the largest over the
smallest (1.0: a store costs the same however full the disk tier is).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from kvtier.config import DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore
from kvtier.tiers.disk_index import _RECORD, DiskIndex
from kvtier.tiers.page_format import HEADER_BYTES
from kvtier.tiers.slot_file import DiskWrite

PAGE_BYTES = 64 << 10
SLOT_BYTES = PAGE_BYTES + HEADER_BYTES  # header and payload, packed at 64 bytes
BATCH = 64


def _batches(rng: random.Random, rounds: int, first_slot: int) -> list[list[tuple[bytes, int]]]:
    return [[(rng.randbytes(32), (first_slot + r * BATCH + i) * SLOT_BYTES) for i in range(BATCH)]
            for r in range(rounds)]


def bench_index(root: Path, resident: int, rounds: int) -> tuple[float, float]:
    rng = random.Random(resident)
    payload = np.zeros(PAGE_BYTES, np.uint8)  # the index reads only its size
    index = DiskIndex(root, capacity_bytes=(resident + 2 * rounds * BATCH + 1)
                      * SLOT_BYTES, chunk_bytes=SLOT_BYTES * BATCH, on_damage=_raise)
    try:
        for start in range(0, resident, 4096):
            index.add([DiskWrite(rng.randbytes(32), slot * SLOT_BYTES, payload, slot)
                       for slot in range(start, min(start + 4096, resident))])
        add_times, remove_times = [], []
        batches = _batches(rng, rounds, resident)
        for batch in batches:
            writes = [DiskWrite(key, slot, payload, slot) for key, slot in batch]
            started = time.perf_counter()
            index.add(writes)
            add_times.append(time.perf_counter() - started)
        for batch in batches:
            started = time.perf_counter()
            index.remove(batch)
            remove_times.append(time.perf_counter() - started)
        return _per_page_us(add_times), _per_page_us(remove_times)
    finally:
        index.close()


def bench_key_first(root: Path, resident: int, rounds: int) -> float:
    rng = random.Random(resident)
    env = lmdb.open(str(root / "key-first"), map_size=max(256 << 20, resident * 512),
                    max_dbs=4, sync=False, metasync=False, readahead=False)
    try:
        pages = env.open_db(b"pages")
        for start in range(0, resident, 4096):
            with env.begin(write=True, db=pages) as txn:
                txn.cursor().putmulti([(rng.randbytes(32) + (slot * SLOT_BYTES).to_bytes(8, "big"),
                                        _RECORD.pack(slot * SLOT_BYTES, PAGE_BYTES, slot, 0.0, 0))
                                       for slot in range(start, min(start + 4096, resident))])
        times = []
        for batch in _batches(rng, rounds, resident):
            started = time.perf_counter()
            items = [(key + slot.to_bytes(8, "big"), _RECORD.pack(slot, PAGE_BYTES, 1, 0.0, 0))
                     for key, slot in batch]
            with env.begin(write=True, db=pages) as txn:
                txn.cursor().putmulti(items)
            times.append(time.perf_counter() - started)
        return _per_page_us(times)
    finally:
        env.close()


def bench_store(root: Path, resident: int) -> float:
    """Median us a page of write-through stores into a disk tier holding `resident` pages."""
    namespace = Namespace("bench", "bfloat16", "page_first", 16, PAGE_BYTES)
    rng = np.random.default_rng(resident)
    pages = rng.integers(0, 255, (1024, PAGE_BYTES), dtype=np.uint8)
    config = StoreConfig(
        host=HostConfig(capacity_bytes=256 << 20, chunk_bytes=4 << 20),
        disk=DiskConfig(path=root / "disk", capacity_bytes=(resident + 2048) * SLOT_BYTES,
                        chunk_bytes=SLOT_BYTES * 1024),
        write_policy=WritePolicy.WRITE_THROUGH)

    def store_all(keys: list[bytes]) -> float:
        elapsed = 0.0
        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            started = time.perf_counter()
            result = store.store(namespace, batch, pages[start : start + len(batch)])
            elapsed += time.perf_counter() - started
            if not result.ok:
                raise RuntimeError(f"store failed: {next(iter(result.failed.values()))}")
        return elapsed / len(keys) * 1e6

    with PageStore(config) as store:
        for start in range(0, resident, len(pages)):  # the resident pages, the same bytes over
            store_all([rng.bytes(16) for _ in range(min(len(pages), resident - start))])
        timed = [rng.bytes(16) for _ in range(len(pages))]
        rounds = []
        for _ in range(8):  # the first is a warm-up
            rounds.append(store_all(timed))
            store.delete(namespace, timed)
        return statistics.median(rounds[1:])


def _per_page_us(times: list[float]) -> float:
    return statistics.median(times) / BATCH * 1e6


def _raise(exc: BaseException) -> None:
    raise exc


def run(resident_sizes: list[int], rounds: int, store_sizes: list[int], store_dir: Path
        ) -> dict:
    results: dict = {"batch_pages": BATCH, "page_bytes": PAGE_BYTES, "rounds": rounds}
    for resident in store_sizes:
        root = Path(tempfile.mkdtemp(prefix="kvtier-bench-index-", dir=store_dir))
        try:
            results[f"store_us_{resident}"] = round(bench_store(root, resident), 2)
        finally:
            shutil.rmtree(root)
    if store_sizes:
        results["store_growth_ratio"] = round(results[f"store_us_{max(store_sizes)}"]
                                              / results[f"store_us_{min(store_sizes)}"], 3)
    for resident in resident_sizes:
        root = Path(tempfile.mkdtemp(prefix="kvtier-bench-index-"))
        try:
            add_us, remove_us = bench_index(root, resident, rounds)
            key_first_us = bench_key_first(root, resident, rounds)
        finally:
            shutil.rmtree(root)
        results[f"add_us_{resident}"] = round(add_us, 2)
        results[f"remove_us_{resident}"] = round(remove_us, 2)
        results[f"key_first_add_us_{resident}"] = round(key_first_us, 2)
        results[f"add_ratio_{resident}"] = round(add_us / key_first_us, 3)
    smallest, largest = min(resident_sizes), max(resident_sizes)
    results["growth_ratio"] = round(results[f"add_us_{largest}"] / results[f"add_us_{smallest}"],
                                    3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--resident", default="0,50000,200000",
                        help="comma-separated numbers of records already indexed")
    parser.add_argument("--rounds", type=int, default=64, help="64-page batches timed per size")
    parser.add_argument("--stores", default="",
                        help="also time write-through stores into a disk tier holding these "
                             "comma-separated numbers of 64 KiB pages (e.g. 0,50000)")
    parser.add_argument("--store-dir", type=Path, default=Path("/dev/shm"),
                        help="where the --stores disk tier lives (needs pages x 64 KiB)")
    args = parser.parse_args()
    sizes = sorted({int(size) for size in args.resident.split(",")})
    store_sizes = sorted({int(size) for size in args.stores.split(",") if size})
    if not sizes or sizes[0] < 0 or args.rounds < 1 or (store_sizes and store_sizes[0] < 0):
        parser.error("--resident and --stores take sizes >= 0, --rounds at least 1")
    results = run(sizes, args.rounds, store_sizes, args.store_dir)
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'resident':>9} {'add us/page':>12} {'remove':>8} {'key first':>10} {'ratio':>6}")
    for size in sizes:
        print(f"{size:>9} {results[f'add_us_{size}']:>12} {results[f'remove_us_{size}']:>8} "
              f"{results[f'key_first_add_us_{size}']:>10} {results[f'add_ratio_{size}']:>6}")
    print(f"growth_ratio (add at {sizes[-1]} / at {sizes[0]}): {results['growth_ratio']}")
    for size in store_sizes:
        print(f"write-through store into a disk tier of {size} pages: "
              f"{results[f'store_us_{size}']} us a page")
    if store_sizes:
        print(f"store_growth_ratio: {results['store_growth_ratio']}")


if __name__ == "__main__":
    main()
