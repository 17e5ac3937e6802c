"""The daemon's own figures, and the stats snapshot that joins them with the store's.

Per verb: the answer times of the last `LATENCY_WINDOW` requests (for p50 and p99) and a
cumulative histogram (for Prometheus); per lane (store, recall): bytes moved and busy seconds.
`snapshot` is the one source of the daemon's figures: `kvtier stats` shows it, and the metrics
endpoint (`kvtier.daemon.metrics`) derives its series from it at scrape time.
Verbs: `record_latency`, `count_lane`, `snapshot`.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier import __version__
from kvtier.daemon.session import Session
from kvtier.store.page_store import PageStore
from kvtier.store.stats import LATENCY_BUCKETS_S, LatencyHistogram

LATENCY_WINDOW = 4096  # recent requests per verb kept for percentiles


@dataclass(slots=True)
class _LaneCounters:
    bytes_moved: int = 0
    busy_s: float = 0.0


class ServiceStats:
    """What the daemon measures of its own work, recorded from the loop and the copy threads."""

    def __init__(self) -> None:
        self._latencies_us: dict[str, deque[float]] = {}
        self._histograms: dict[str, LatencyHistogram] = {}  # cumulative, for Prometheus
        self._lanes = {"store": _LaneCounters(), "recall": _LaneCounters()}
        self._started_s = time.monotonic()

    def record_latency(self, verb: str, started: float) -> None:
        """Count one `verb` answered, begun at `time.perf_counter()` `started`."""
        elapsed_s = time.perf_counter() - started
        window = self._latencies_us.get(verb)  # not setdefault: no deque built per request
        if window is None:
            window = self._latencies_us.setdefault(verb, deque(maxlen=LATENCY_WINDOW))
        window.append(elapsed_s * 1e6)
        histogram = self._histograms.get(verb)  # not setdefault: no histogram built per request
        if histogram is None:
            histogram = self._histograms.setdefault(verb, LatencyHistogram())
        histogram.observe(elapsed_s)

    def count_lane(self, lane: str, num_bytes: int, started: float) -> None:
        """Count `num_bytes` moved on `lane` ("store" or "recall") by a request begun at
        `started` (`time.perf_counter()`)."""
        counters = self._lanes[lane]
        counters.bytes_moved += num_bytes
        counters.busy_s += time.perf_counter() - started

    def snapshot(self, store: PageStore, sessions: Iterable[Session],
                 num_jobs_in_flight: int, num_index_keys_refused: int) -> dict[str, Any]:
        """Store figures plus the daemon's: clients, per-verb latency, bytes and GB/s per lane,
        and the held keys the lookup plane's indexes refused (clients' local lookups miss them).

        Per verb, `count`, `p50_us` and `p99_us` are of the last LATENCY_WINDOW requests;
        `total`, `sum_s` and `bucket_counts` (over `latency_buckets_s`) count every request
        since start.
        """
        latency: dict[str, dict[str, Any]] = {}
        # Snapshots: copy threads add verbs and samples while this runs.
        for verb, window in list(self._latencies_us.items()):
            values = np.fromiter(list(window), np.float64)
            p50, p99 = percentiles(values, (50.0, 99.0))
            latency[verb] = {"count": len(values), "p50_us": p50, "p99_us": p99}
            histogram = self._histograms.get(verb)
            if histogram is not None:
                latency[verb].update(histogram.snapshot())
        lanes = {name: {"bytes": c.bytes_moved, "busy_s": c.busy_s,
                        "gbps": c.bytes_moved / c.busy_s / 1e9 if c.busy_s else 0.0}
                 for name, c in self._lanes.items()}
        # The transfer engines' own lanes: bytes, ticks and GB/s while the lane was copying.
        engines = {f"{prefix}{key}": {direction.value: {
                       "bytes": lane.bytes_moved, "ticks": lane.num_ticks, "busy_s": lane.busy_s,
                       "gbps": lane.bytes_moved / lane.busy_s / 1e9 if lane.busy_s else 0.0}
                   for direction, lane in engine.lane_stats().items()}
                   for prefix, group in (("", store.lanes_by_key), ("hbm:", store.hbm_lanes_by_key))
                   for key, engine in list(group.items())}
        clients = [{"client_id": s.client_id, "name": s.name, "pid": s.pid, "uid": s.uid,
                    "pools": len(s.pools), "leases": len(s.lease_ids)}
                   for s in list(sessions)]
        return {**store.stats().to_dict(), "latency": latency, "lanes": lanes,
                "engines": engines, "clients": clients,
                "uptime_s": time.monotonic() - self._started_s,
                "latency_buckets_s": list(LATENCY_BUCKETS_S),
                "jobs_in_flight": num_jobs_in_flight, "policies": _policies(store),
                "index_keys_refused": num_index_keys_refused,
                "version": __version__, "python_allocator": python_allocator()}


def python_allocator() -> str:
    """"pymalloc" (CPython's default: fast, but a large delete leaves arenas that survivors pin)
    or "malloc" (PYTHONMALLOC=malloc: the heap goes back after a large delete); pymalloc is the
    only allocator that counts blocks."""
    return "pymalloc" if sys.getallocatedblocks() else "malloc"


def _policies(store: PageStore) -> dict[str, str]:
    """The eviction policy of each tier that is on, and the write policy."""
    config = store.config
    policies = {"host": config.host.policy}
    if store.hbm is not None:
        policies["hbm"] = config.hbm.policy
    if store.disk is not None:
        policies["disk"] = config.disk.policy
    policies["write"] = config.write_policy.value
    return policies


def percentiles(values: np.ndarray, percents: tuple[float, ...]) -> list[float]:
    """`np.percentile(values, percents)` (linear interpolation) by one partial sort: a tenth of
    its cost on a 4096-sample window, and stats run on the event loop for every scrape."""
    positions = [p / 100 * (len(values) - 1) for p in percents]
    bounds = sorted({int(np.floor(x)) for x in positions} | {int(np.ceil(x)) for x in positions})
    ranked = np.partition(values, bounds)
    return [float(ranked[int(np.floor(x))] + (ranked[int(np.ceil(x))] - ranked[int(np.floor(x))])
                  * (x - np.floor(x))) for x in positions]
