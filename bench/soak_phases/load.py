"""Soak phase `load`: many client processes, mixed verbs on overlapping keys, recalls verified.

16 client processes for a bounded time doing lookup / store / recall / delete (each stores and
deletes only its own keys, lookups and recalls cross over), write-through with a disk tier large
enough that nothing is dropped; lost = an acknowledged, never deleted key not served. The
daemon's RSS is sampled against host capacity + `RSS_OVERHEAD_BYTES`.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from soak_phases.common import (
    RSS_OVERHEAD_BYTES,
    Figures,
    Pager,
    key_of,
    running_daemon,
    serve_args,
)

LOAD_KEYS_PER_WORKER = 128
LOAD_BATCH = 4
LOAD_OPS = ("lookup", "store", "recall", "delete")
LOAD_WEIGHTS = (4, 2, 3, 1)


def load_worker(worker: int, num_workers: int, socket_path: str, duration_s: float, seed: int,
                ready: multiprocessing.Queue, go: multiprocessing.Event,
                results: multiprocessing.Queue) -> None:
    """One load client: mixed verbs for `duration_s`; puts its figures on `results`."""
    rng = random.Random(seed * 1000 + worker)
    figures = {"worker": worker, "wrong": 0, "lost": 0, "store_failures": 0, "error": ""}
    latencies: dict[str, list[float]] = {op: [] for op in LOAD_OPS}
    alive: set[bytes] = set()
    own = [key_of("load", worker, i) for i in range(LOAD_KEYS_PER_WORKER)]
    everyone = [key_of("load", w, i) for w in range(num_workers)
                for i in range(LOAD_KEYS_PER_WORKER)]
    pager = Pager(Path(socket_path), f"load-{worker}")
    ready.put(worker)
    go.wait()
    deadline = time.monotonic() + duration_s
    try:
        while time.monotonic() < deadline:
            op = rng.choices(LOAD_OPS, LOAD_WEIGHTS)[0]
            mine = rng.sample(own, LOAD_BATCH)
            keys = mine if op in ("store", "delete") else rng.sample(everyone + own, LOAD_BATCH)
            started = time.perf_counter()
            if op == "lookup":
                missing = pager.lookup_missing(keys)
            elif op == "store":
                failed = pager.store(keys)
            elif op == "recall":
                served, num_wrong, _ = pager.recall(keys)
            else:
                pager.client.delete(pager.handle, keys)
            latencies[op].append((time.perf_counter() - started) * 1e6)
            if op == "lookup":
                figures["lost"] += len(missing & alive)
            elif op == "store":
                figures["store_failures"] += len(failed)
                alive.update(k for k in keys if k not in failed)
            elif op == "recall":
                figures["wrong"] += num_wrong
                figures["lost"] += len((set(keys) & alive) - served)
            else:
                alive.difference_update(keys)
    except Exception as exc:  # reported, and counted by the parent as a failed worker
        figures["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        pager.close()
    figures["alive"] = sorted(alive)
    figures["latencies"] = {op: np.asarray(v, np.float32) for op, v in latencies.items()}
    results.put(figures)


class RssSampler(threading.Thread):
    """The daemon's peak resident set, sampled every 20 ms until `stop`."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak_bytes = self.process.memory_info().rss
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak_bytes


def phase_load(work: Path, num_workers: int, duration_s: float, seed: int) -> Figures:
    """Many client processes, mixed verbs on overlapping keys, every recall verified."""
    socket_path = work / "load.sock"
    host_bytes = 8 << 20
    args = serve_args(work / "load-disk", "8MiB", "96MiB", "--write-policy", "write-through")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["kvtier.client", "numpy"])
    with running_daemon(socket_path, *args) as daemon:
        ready, results, go = context.Queue(), context.Queue(), context.Event()
        workers = [context.Process(target=load_worker, args=(
            w, num_workers, str(socket_path), duration_s, seed, ready, go, results))
            for w in range(num_workers)]
        for process in workers:
            process.start()
        for _ in workers:
            ready.get(timeout=120)
        sampler = RssSampler(daemon.pid)
        baseline_rss = sampler.peak_bytes
        sampler.start()
        started = time.monotonic()
        go.set()
        outcomes = [results.get(timeout=duration_s + 120) for _ in workers]
        elapsed_s = time.monotonic() - started
        for process in workers:
            process.join(30)
        peak_rss = sampler.stop()
        latencies = {op: np.concatenate([o["latencies"][op] for o in outcomes]) for op in LOAD_OPS}
        everything = np.concatenate(list(latencies.values()))
        alive = [key for o in outcomes for key in o["alive"]]
        verifier = Pager(socket_path, "load-verifier")
        try:
            served, final_wrong, _ = verifier.recall(alive)
            problems = verifier.client.check()
        finally:
            verifier.close()
    figures: Figures = {
        "clients": num_workers, "duration_s": round(elapsed_s, 2), "ops": int(everything.size),
        "ops_per_s": round(everything.size / elapsed_s),
        "p50_us": round(float(np.percentile(everything, 50)), 1),
        "p99_us": round(float(np.percentile(everything, 99)), 1),
        "wrong_pages": sum(o["wrong"] for o in outcomes) + final_wrong,
        "lost_pages": sum(o["lost"] for o in outcomes) + len(set(alive) - served),
        "store_failures": sum(o["store_failures"] for o in outcomes),
        "worker_errors": [o["error"] for o in outcomes if o["error"]],
        "final_alive_pages": len(alive), "check_problems": len(problems),
        "check_problem_examples": problems[:3],
        "rss_baseline_mib": baseline_rss >> 20, "rss_peak_mib": peak_rss >> 20,
        "rss_bound_mib": (host_bytes + RSS_OVERHEAD_BYTES) >> 20,
        "rss_over_bound_mib": max(0, (peak_rss - host_bytes - RSS_OVERHEAD_BYTES) >> 20),
    }
    for op, values in latencies.items():
        figures[f"{op}_ops"] = int(values.size)
        if values.size:
            figures[f"{op}_p50_us"] = round(float(np.percentile(values, 50)), 1)
            figures[f"{op}_p99_us"] = round(float(np.percentile(values, 99)), 1)
    return figures
