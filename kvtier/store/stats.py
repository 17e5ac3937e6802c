"""Counters a store keeps, the snapshot `PageStore.stats()` returns, and request latency
histograms."""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import asdict, dataclass

# Upper bounds of the request latency histograms, in seconds. A lookup answered on the event loop
# takes 5-50 us, a remote round trip about a millisecond, a store or recall of a long request tens
# to hundreds of milliseconds: the bounds cover all of them at roughly 2.5x steps.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class TierCounters:
    """Running counters of one tier; a lookup that reaches a tier counts one hit or one miss."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


@dataclass(slots=True, frozen=True)
class TierStats:
    """One tier at one moment."""

    tier: str
    capacity_bytes: int
    used_bytes: int
    num_pages: int
    hits: int
    misses: int
    evictions: int
    bytes_written: int
    bytes_read: int

    @property
    def hit_ratio(self) -> float:
        """hits / (hits + misses), 0.0 before the first lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(slots=True)
class StoreCounters:
    """Running counters of the whole store."""

    pages_stored: int = 0
    pages_recalled: int = 0
    bytes_stored: int = 0
    bytes_recalled: int = 0
    promotions: int = 0
    demotions: int = 0
    demotion_failures: int = 0
    pages_dropped: int = 0  # evicted from their last tier: no copy left on this node
    integrity_errors: int = 0
    store_failures: int = 0


@dataclass(slots=True, frozen=True)
class StoreStats:
    """A snapshot of the store: per tier figures and store-wide counters."""

    tiers: tuple[TierStats, ...]
    counters: StoreCounters
    num_leases: int
    num_namespaces: int
    remote: dict | None = None  # the remote tier's figures (`RemoteTier.stats`), when there is one

    def tier(self, name: str) -> TierStats:
        """The figures of tier `name` ("host", "disk")."""
        for tier in self.tiers:
            if tier.tier == name:
                return tier
        raise KeyError(name)

    def to_dict(self) -> dict:
        """Plain data for JSON output, hit ratios included."""
        tiers = [{**asdict(t), "hit_ratio": t.hit_ratio} for t in self.tiers]
        return {"tiers": tiers, "counters": asdict(self.counters),
                "num_leases": self.num_leases, "num_namespaces": self.num_namespaces,
                "remote": self.remote}


class LatencyHistogram:
    """Cumulative latencies of one verb in the fixed `LATENCY_BUCKETS_S`: what Prometheus's
    `rate()` and `histogram_quantile()` need, where the recent-window percentiles cannot serve.

    Each recording thread (the event loop, each copy thread) counts into its own row, so
    `observe` takes no lock (a lock was half its cost) and no increment is lost between threads;
    `snapshot` adds the rows up. A row outlives its thread: counts never go back.
    """

    __slots__ = ("_local", "_rows", "_rows_lock")

    def __init__(self) -> None:
        self._local = threading.local()
        self._rows: list[list[float]] = []  # per thread: bucket counts, then the sum of seconds
        self._rows_lock = threading.Lock()  # taken once per thread, to add its row

    def observe(self, seconds: float) -> None:
        """Count one request that took `seconds`."""
        try:
            row = self._local.row
        except AttributeError:
            row = self._new_row()
        # bisect_left: a value equal to a bound belongs to that bucket (Prometheus's `le`).
        row[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        row[-1] += seconds

    def _new_row(self) -> list[float]:
        row = [0] * (len(LATENCY_BUCKETS_S) + 1) + [0.0]
        with self._rows_lock:
            self._rows.append(row)
        self._local.row = row
        return row

    def snapshot(self) -> dict:
        """`bucket_counts` (per bucket, not cumulative; the last one past the largest bound),
        `sum_s` and `total` (the sum of `bucket_counts`, so the two always agree)."""
        with self._rows_lock:
            rows = [list(row) for row in self._rows]  # a list copy is one step for the GIL
        counts = [sum(row[i] for row in rows) for i in range(len(LATENCY_BUCKETS_S) + 1)]
        return {"bucket_counts": counts, "sum_s": float(sum(row[-1] for row in rows)),
                "total": sum(counts)}
