"""Throughput of the host and disk tiers, each beside the machine's own limit in the same run.

Run:

    python bench/bench_tiers.py [--json] [--total-mib 256] [--repeats 5] [--dir DIR] [--quick]
        [--host-policy NAME]

For 64 KiB and 2 MiB pages, `--total-mib` of seeded random pages (keys and bytes from `--seed`),
stored and recalled in batches of 64 pages of one request (one `PageStore` call per batch):

- host store / recall: a `PageStore` with the disk tier disabled, write-back, the host arena larger
  than the total so nothing is evicted; pages are deleted between repetitions so each one stores
  fresh. Baseline: `np.copyto` page by page from the same source rows into a pre-faulted
  shared-memory segment (store), and from it into the same pre-faulted output array (recall).
- disk store until durable: write-through into a disk tier under `--dir` (timed: the store call,
  which returns once pages are fdatasync'd and indexed). Baseline: `os.pwrite` page by page into a
  raw preallocated file on the same file system, then `os.fdatasync`, once per batch. For
  reference (no target), a second raw writer does the same but starts the device writing every
  1 MiB (`sync_file_range`), as the disk tier does: `disk_store_early_writeback_*`. Two warm-up
  rounds here: the slot file's chunks alternate between repetitions (a freed chunk is reused
  last-freed first) and the first write into a preallocated extent costs ext4 a conversion, so
  one warm-up would leave the first timed round writing a chunk never written before; the raw
  files are written whole by their first warm-up.
- disk cold recall: a fresh `PageStore` on the same directory (recovered from the index), the slot
  file's page cache dropped (`POSIX_FADV_DONTNEED`), then recall of every page. Baseline:
  `os.preadv` with `O_DIRECT` page by page from the raw file into a page-aligned mmap, after the
  same fadvise.

One warm-up round of each measurement (two for the disk store) is excluded. Each figure is the
median GB/s over `--repeats` repetitions (GB = 1e9 bytes of payload); p99 is of per-batch latency
over all repetitions. Ratios are kvtier / baseline; headline ratios are the minimum over page sizes.
Targets: host ratios >= 0.85, disk ratios >= 0.8. `--json` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.config import DEFAULT_HOST_POLICY, DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.keys import KEY_BYTES, Namespace
from kvtier.shm import SharedSegment, new_segment_name
from kvtier.store.page_store import PageStore
from kvtier.tiers.disk import WRITE_RUN_BYTES
from kvtier.tiers.slots import align_up
from kvtier.tiers.writeback import start_writeback

PAGE_SIZES = {"64k": 64 << 10, "2m": 2 << 20}
BATCH_PAGES = 64
CHUNK_BYTES = 256 << 20
HOST_TARGET = 0.85
DISK_TARGET = 0.8
DEFAULT_DIR = Path(__file__).resolve().parent / ".tmp"  # on the repo's file system, not tmpfs

log_console = Console(stderr=True)


@dataclass(slots=True)
class Workload:
    """Seeded pages of one size: `pages[i]` is stored under `keys[i]`."""

    label: str
    namespace: Namespace
    keys: list[bytes]
    pages: np.ndarray  # [num_pages, page_bytes] uint8

    @property
    def total_bytes(self) -> int:
        return self.pages.nbytes

    def batches(self) -> list[slice]:
        num_pages = len(self.keys)
        return [slice(i, min(i + BATCH_PAGES, num_pages)) for i in range(0, num_pages, BATCH_PAGES)]


@dataclass(slots=True)
class Samples:
    """Per-repetition totals and per-batch latencies of one measurement."""

    total_bytes: int
    repetition_s: list[float]
    batch_s: list[float]

    @property
    def gbps(self) -> float:
        return self.total_bytes / statistics.median(self.repetition_s) / 1e9

    @property
    def p99_us(self) -> float:
        return float(np.percentile(self.batch_s, 99)) * 1e6

    @property
    def median_batch_us(self) -> float:
        return statistics.median(self.batch_s) * 1e6


def make_workload(label: str, page_bytes: int, total_bytes: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    num_pages = max(1, total_bytes // page_bytes)
    keys_blob = rng.bytes(num_pages * KEY_BYTES)
    keys = [keys_blob[i : i + KEY_BYTES] for i in range(0, len(keys_blob), KEY_BYTES)]
    pages = np.frombuffer(rng.bytes(num_pages * page_bytes),
                          np.uint8).reshape(num_pages, page_bytes)
    namespace = Namespace("bench-tiers", "bfloat16", "page-first", 16, page_bytes)
    return Workload(label, namespace, keys, pages.copy())


def prefaulted(shape: tuple[int, int]) -> np.ndarray:
    array = np.empty(shape, np.uint8)
    array.fill(0)  # first-touch faults would otherwise land in the first timed copy
    return array


def time_batches(workload: Workload,
                 run_batch: Callable[[slice], None]) -> tuple[float, list[float]]:
    """Run `run_batch` over every batch; return the total and the per-batch seconds."""
    gc.collect()
    batch_s = []
    for batch in workload.batches():
        start = time.perf_counter()
        run_batch(batch)
        batch_s.append(time.perf_counter() - start)
    return sum(batch_s), batch_s


def measure(workload: Workload, repeats: int, steps: dict[str, Callable[[slice], None]],
            between: Callable[[int], None] | None = None,
            alternate: bool = False, warmups: int = 1) -> dict[str, Samples]:
    """Interleave `steps` for `warmups` warm-ups and `repeats` timed repetitions.

    With `alternate` (independent steps only) the order rotates every repetition (A B C,
    B C A, C A B, ...) so no step always runs right after another's disk writeback.
    `between(repetition)` runs untimed after each repetition, warm-ups being negative.
    """
    samples = {name: Samples(workload.total_bytes, [], []) for name in steps}
    for repetition in range(-warmups, repeats):
        ordered = list(steps.items())
        shift = (repetition + 1) % len(ordered) if alternate else 0
        for name, run_batch in ordered[shift:] + ordered[:shift]:
            total_s, batch_s = time_batches(workload, run_batch)
            if repetition >= 0:
                samples[name].repetition_s.append(total_s)
                samples[name].batch_s.extend(batch_s)
        if between is not None:
            between(repetition)
    return samples


def check_ok(result, num_pages: int, verb: str) -> None:
    if not result.ok or len(result.stored if verb == "store" else result.recalled) != num_pages:
        raise RuntimeError(f"{verb} failed during the benchmark: {result}")


def bench_host(workload: Workload, repeats: int, policy: str) -> dict[str, Samples]:
    ns, keys, pages = workload.namespace, workload.keys, workload.pages
    config = StoreConfig(
        host=HostConfig(capacity_bytes=align_up(workload.total_bytes, CHUNK_BYTES) + CHUNK_BYTES,
                        chunk_bytes=CHUNK_BYTES, policy=policy),
        disk=DiskConfig(enabled=False),
        write_policy=WritePolicy.WRITE_BACK,
    )
    segment = SharedSegment.create(new_segment_name("kvtier-bench"), workload.total_bytes)
    segment.prefault()
    arena_like = segment.array().reshape(pages.shape)  # the same kind of buffer as the host arena
    out = prefaulted(pages.shape)
    try:
        with PageStore(config) as store:
            def copy_store(batch: slice) -> None:
                for i in range(batch.start, batch.stop):
                    np.copyto(arena_like[i], pages[i])

            def kv_store(batch: slice) -> None:
                check_ok(store.store(ns, keys[batch], pages[batch]), batch.stop - batch.start,
                         "store")

            def copy_recall(batch: slice) -> None:
                for i in range(batch.start, batch.stop):
                    np.copyto(out[i], arena_like[i])

            def kv_recall(batch: slice) -> None:
                check_ok(store.recall(ns, keys[batch], out[batch]), batch.stop - batch.start,
                         "recall")

            def verify_and_delete(_: int) -> None:
                if not np.array_equal(out, pages):
                    raise RuntimeError("host recall returned different bytes")
                out.fill(0)
                store.delete(ns, keys)

            steps = {"copy_store": copy_store, "store": kv_store,
                     "copy_recall": copy_recall, "recall": kv_recall}
            return measure(workload, repeats, steps, verify_and_delete)
    finally:
        arena_like = None  # a view of the segment: gone before it closes
        segment.close()
        segment.unlink()


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_config(workload: Workload, path: Path) -> StoreConfig:
    # Host holds every page: write-through stores to host too, and recall promotes disk hits.
    host_bytes = align_up(workload.total_bytes, CHUNK_BYTES) + CHUNK_BYTES
    disk_bytes = align_up(workload.total_bytes * 9 // 8, CHUNK_BYTES) + CHUNK_BYTES
    return StoreConfig(
        host=HostConfig(capacity_bytes=host_bytes, chunk_bytes=CHUNK_BYTES),
        disk=DiskConfig(path=path, capacity_bytes=disk_bytes, chunk_bytes=CHUNK_BYTES),
        write_policy=WritePolicy.WRITE_THROUGH,
    )


def bench_disk(workload: Workload, repeats: int, root: Path) -> dict[str, Samples]:
    ns, keys, pages = workload.namespace, workload.keys, workload.pages
    page_bytes = ns.page_bytes
    store_dir = root / f"store-{workload.label}"
    raw_path = root / f"raw-{workload.label}.bin"
    early_path = root / f"raw-early-{workload.label}.bin"
    config = disk_config(workload, store_dir)
    raw_fd = os.open(raw_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(raw_fd, 0, workload.total_bytes)  # like the slot file: real blocks
    early_fd = os.open(early_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(early_fd, 0, workload.total_bytes)
    direct_fd = os.open(raw_path, os.O_RDONLY | os.O_DIRECT)
    raw_buffer = mmap.mmap(-1, workload.total_bytes)  # page-aligned, as O_DIRECT needs
    raw_out = np.frombuffer(raw_buffer, np.uint8).reshape(pages.shape)
    raw_out.fill(0)
    out = prefaulted(pages.shape)
    try:
        store = PageStore(config)

        def raw_write(batch: slice) -> None:
            for i in range(batch.start, batch.stop):
                os.pwrite(raw_fd, pages[i], i * page_bytes)
            os.fdatasync(raw_fd)

        pages_per_run = max(1, WRITE_RUN_BYTES // page_bytes)

        def raw_write_early(batch: slice) -> None:
            for run_start in range(batch.start, batch.stop, pages_per_run):
                run_stop = min(run_start + pages_per_run, batch.stop)
                for i in range(run_start, run_stop):
                    os.pwrite(early_fd, pages[i], i * page_bytes)
                start_writeback(early_fd, run_start * page_bytes,
                                (run_stop - run_start) * page_bytes)
            os.fdatasync(early_fd)

        def kv_store(batch: slice) -> None:
            check_ok(store.store(ns, keys[batch], pages[batch]), batch.stop - batch.start, "store")

        def delete_unless_last(repetition: int) -> None:
            if repetition < repeats - 1:
                store.delete(ns, keys)

        written = measure(workload, repeats, {"raw_write": raw_write, "store": kv_store,
                                              "raw_write_early": raw_write_early},
                          delete_unless_last, alternate=True, warmups=2)
        store.close()

        def raw_read(batch: slice) -> None:
            for i in range(batch.start, batch.stop):
                got = os.preadv(direct_fd, [raw_out[i]], i * page_bytes)
                if got != page_bytes:
                    raise RuntimeError(f"short O_DIRECT read: {got} of {page_bytes} bytes")

        recall_store: list[PageStore] = []

        def kv_recall(batch: slice) -> None:
            check_ok(recall_store[0].recall(ns, keys[batch], out[batch]),
                     batch.stop - batch.start, "recall")

        def cold_start() -> None:
            # Untimed: a fresh store recovers from the index, its host tier empty, caches dropped.
            if recall_store:
                recall_store.pop().close()
            recall_store.append(PageStore(config))
            drop_page_cache(raw_path)
            drop_page_cache(store_dir / "pages.slots")

        def verify(_: int) -> None:
            if not np.array_equal(out, pages) or not np.array_equal(raw_out, pages):
                raise RuntimeError("cold recall returned different bytes")
            out.fill(0)
            raw_out.fill(0)
            cold_start()

        cold_start()
        read = measure(workload, repeats, {"raw_read": raw_read, "recall": kv_recall}, verify,
                       alternate=True)
        recall_store.pop().close()
        return written | read
    finally:
        raw_out = None  # a view of the buffer: gone before it closes
        raw_buffer.close()
        os.close(direct_fd)
        os.close(raw_fd)
        os.close(early_fd)


def ratio_row(results: dict, prefix: str, label: str, samples: Samples, base: Samples) -> None:
    ratio = samples.gbps / base.gbps
    results[f"{prefix}_gbps_{label}"] = round(samples.gbps, 3)
    results[f"{prefix}_baseline_gbps_{label}"] = round(base.gbps, 3)
    results[f"{prefix}_ratio_{label}"] = round(ratio, 3)
    results[f"{prefix}_p99_batch_us_{label}"] = round(samples.p99_us, 1)
    results[f"{prefix}_baseline_p99_batch_us_{label}"] = round(base.p99_us, 1)
    results[f"{prefix}_median_batch_us_{label}"] = round(samples.median_batch_us, 1)


MEASUREMENTS = [  # (result prefix, kvtier step, baseline step, baseline name, target)
    ("host_store", "store", "copy_store", "np.copyto -> shm", HOST_TARGET),
    ("host_recall", "recall", "copy_recall", "np.copyto shm ->", HOST_TARGET),
    ("disk_store", "store", "raw_write", "pwrite+fdatasync", DISK_TARGET),
    ("disk_recall", "recall", "raw_read", "O_DIRECT preadv", DISK_TARGET),
    # For reference only: the raw writer that also starts writeback early, as the disk tier does.
    ("disk_store_early_writeback", "store", "raw_write_early", "pwrite+writeback+fdatasync",
     None),
]


def run(args: argparse.Namespace) -> dict:
    total_bytes = args.total_mib << 20
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    results: dict = {
        "machine": {
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "page_sizes": PAGE_SIZES, "total_bytes": total_bytes, "batch_pages": BATCH_PAGES,
            "repeats": args.repeats, "seed": args.seed, "dir": str(args.dir),
            "host_policy": args.host_policy,
        },
        "targets": {"host_ratio": HOST_TARGET, "disk_ratio": DISK_TARGET},
    }
    try:
        for label, page_bytes in PAGE_SIZES.items():
            workload = make_workload(label, page_bytes, total_bytes, args.seed)
            log_console.log(f"host tier, {label} pages")
            host = bench_host(workload, args.repeats, args.host_policy)
            log_console.log(f"disk tier, {label} pages")
            disk = bench_disk(workload, args.repeats, root)
            for prefix, step, base, _, _ in MEASUREMENTS:
                samples = host if prefix.startswith("host") else disk
                ratio_row(results, prefix, label, samples[step], samples[base])
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.dir == DEFAULT_DIR:
            try:
                args.dir.rmdir()
            except OSError:
                pass
    for prefix, _, _, _, target in MEASUREMENTS:
        ratio = min(results[f"{prefix}_ratio_{label}"] for label in PAGE_SIZES)
        results[f"{prefix}_ratio"] = ratio
        if target is not None:
            results[f"{prefix}_pass"] = ratio >= target
    return results


def print_table(results: dict) -> None:
    machine = results["machine"]
    table = Table(title=f"kvtier tiers: {machine['total_bytes'] >> 20} MiB per run, "
                        f"batches of {machine['batch_pages']} pages, median of "
                        f"{machine['repeats']}, {machine['cpu_count']} CPUs")
    for column in ("measurement", "page", "kvtier GB/s", "baseline", "baseline GB/s", "ratio",
                   "p99 batch us (kvtier / base)", "target", ""):
        table.add_column(column,
                         justify="left" if column in ("measurement", "baseline") else "right")
    for prefix, _, _, base_name, target in MEASUREMENTS:
        for label in PAGE_SIZES:
            ratio = results[f"{prefix}_ratio_{label}"]
            table.add_row(prefix, label, f"{results[f'{prefix}_gbps_{label}']:.2f}", base_name,
                          f"{results[f'{prefix}_baseline_gbps_{label}']:.2f}", f"{ratio:.2f}",
                          f"{results[f'{prefix}_p99_batch_us_{label}']:.0f} / "
                          f"{results[f'{prefix}_baseline_p99_batch_us_{label}']:.0f}",
                          "-" if target is None else f">= {target}",
                          "" if target is None
                          else "[green]pass" if ratio >= target else "[red]FAIL")
    console = Console()
    console.print(table)
    for prefix, _, _, _, target in MEASUREMENTS:
        if target is None:
            console.print(f"{prefix}_ratio = {results[f'{prefix}_ratio']:.3f} "
                          f"(min over page sizes, for reference)")
            continue
        verdict = "[green]pass" if results[f"{prefix}_pass"] else "[red]FAIL"
        console.print(f"{prefix}_ratio = {results[f'{prefix}_ratio']:.3f} "
                      f"(min over page sizes, target >= {target}) {verdict}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--total-mib", type=int, default=256, help="MiB of pages per run")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help="directory on the file system to test (not tmpfs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats: a smoke test")
    parser.add_argument("--host-policy", default=DEFAULT_HOST_POLICY,
                        help="the host tier's eviction policy (default: the store's default)")
    args = parser.parse_args()
    if args.quick:
        args.total_mib, args.repeats = 64, 3
    if args.total_mib < 2 or args.repeats < 1:
        parser.error("--total-mib must be at least 2 and --repeats at least 1")
    args.dir = args.dir.resolve()
    return args


def main() -> None:
    args = parse_args()
    results = run(args)
    if args.json:
        print(json.dumps(results))
    else:
        print_table(results)


if __name__ == "__main__":
    from kvtier.tuning import reexec_tuned

    reexec_tuned()  # as the daemon runs: large copies non-temporal, large buffers kept
    main()
