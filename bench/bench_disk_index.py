"""The disk index's cost per page stored and removed, as the index fills.

Run:

    python bench/bench_disk_index.py [--json] [--resident 0,50000,200000] [--rounds 64]

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
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from kvtier.tiers.disk_index import DiskIndex
from kvtier.tiers.slot_file import DiskWrite

PAGE_BYTES = 64 << 10
SLOT_BYTES = PAGE_BYTES + 64  # header and payload, packed at 64 bytes
BATCH = 64
_RECORD = struct.Struct("<QQQdI")  # format 3's value, the same as today's


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


def _per_page_us(times: list[float]) -> float:
    return statistics.median(times) / BATCH * 1e6


def _raise(exc: BaseException) -> None:
    raise exc


def run(resident_sizes: list[int], rounds: int) -> dict:
    results: dict = {"batch_pages": BATCH, "page_bytes": PAGE_BYTES, "rounds": rounds}
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
    args = parser.parse_args()
    sizes = sorted({int(size) for size in args.resident.split(",")})
    if not sizes or sizes[0] < 0 or args.rounds < 1:
        parser.error("--resident takes sizes >= 0, --rounds at least 1")
    results = run(sizes, args.rounds)
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'resident':>9} {'add us/page':>12} {'remove':>8} {'key first':>10} {'ratio':>6}")
    for size in sizes:
        print(f"{size:>9} {results[f'add_us_{size}']:>12} {results[f'remove_us_{size}']:>8} "
              f"{results[f'key_first_add_us_{size}']:>10} {results[f'add_ratio_{size}']:>6}")
    print(f"growth_ratio (add at {sizes[-1]} / at {sizes[0]}): {results['growth_ratio']}")


if __name__ == "__main__":
    main()
