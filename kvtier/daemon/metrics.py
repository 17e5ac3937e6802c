"""Prometheus metrics of the daemon: the families, and the HTTP endpoint that serves them.

One source of figures: every family is derived at scrape time from the `Service.stats()` dict,
the same one `kvtier stats` shows. The snapshot is taken off the daemon's event loop, on the
thread where the stats verb's snapshots are taken, and rendered on the scrape's thread; scrapes
that arrive while one is rendered share the next one. A request does nothing for metrics but one
histogram observation (`LatencyHistogram.observe`), which it does with metrics off too. A
snapshot's time is recorded as the verb "scrape". The HTTP server (`kvtier.daemon.metrics_http`)
serves a bounded number of connections, each with a timeout and a descriptor of the daemon's
budget: 16 looping scrapers or 1,000 slow connections cost the page service little.

Names follow Prometheus's conventions: `kvtier_` prefix, base units (bytes, seconds), counters
end in `_total`. The endpoint listens on loopback unless `metrics.address` says otherwise; it is
bound before anything else starts, so a taken port stops the daemon before it creates its socket
or its arena. Verbs: `families`, `MetricsEndpoint.bind`, `serve`, `close`.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from kvtier.daemon.limits import FdBudget
from kvtier.daemon.metrics_http import ScrapeServer
from kvtier.daemon.service_stats import LATENCY_WINDOW
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

_TIER_COUNTERS = (  # (stats field, family name without prefix, help)
    ("hits", "tier_hits", "Lookups that found the page in this tier."),
    ("misses", "tier_misses", "Lookups that reached this tier and did not find the page."),
    ("evictions", "tier_evictions", "Pages evicted from this tier."),
    ("bytes_written", "tier_written_bytes", "Bytes written into this tier."),
    ("bytes_read", "tier_read_bytes", "Bytes read out of this tier."),
)
_STORE_COUNTERS = (
    ("pages_stored", "stored_pages", "Pages stored by clients."),
    ("pages_recalled", "recalled_pages", "Pages recalled into clients' pools."),
    ("bytes_stored", "stored_bytes", "Bytes stored by clients."),
    ("bytes_recalled", "recalled_bytes", "Bytes recalled into clients' pools."),
    ("promotions", "promotions", "Pages promoted to a faster tier."),
    ("demotions", "demotions", "Pages demoted to a slower tier on eviction."),
    ("demotion_failures", "demotion_failures", "Demotions that failed (the page was dropped)."),
    ("pages_dropped", "dropped_pages",
     "Pages evicted from their last tier: no copy of them is left on this node."),
    ("store_failures", "store_failures", "Pages whose store failed."),
    ("integrity_errors", "integrity_errors",
     "Pages found corrupt (bad header or checksum) and never served."),
)
_REMOTE_COUNTERS = (
    ("pages_written", "remote_written_pages", "Pages sent to the remote tier."),
    ("pages_expired_by_budget", "remote_budget_deleted_pages",
     "Remote pages this node deleted to stay within its budget."),
    ("writes_dropped", "remote_dropped_writes",
     "Remote writes not sent: disconnected, or the send queue was full."),
    ("errors", "remote_errors", "Remote round trips that failed."),
    ("timeouts", "remote_timeouts", "Remote round trips that timed out."),
    ("integrity_errors", "remote_integrity_errors",
     "Remote pages found corrupt and treated as misses."),
    ("outages", "remote_outages", "Times the remote tier went offline."),
)


def families(stats: dict) -> list[Metric]:
    """Every kvtier metric family, from one `Service.stats()` snapshot."""
    out: list[Metric] = []

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"kvtier_{name}", doc, labels=list(labels))
        out.append(family)
        return family

    def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
        family = CounterMetricFamily(f"kvtier_{name}", doc, labels=list(labels))
        out.append(family)
        return family

    def info(name: str, doc: str, labels: tuple[str, ...] = ()) -> InfoMetricFamily:
        family = InfoMetricFamily(f"kvtier_{name}", doc, labels=list(labels))
        out.append(family)
        return family

    info("build", "The daemon's version and the Python allocator it runs with.").add_metric(
        [], {"version": stats["version"], "python_allocator": stats["python_allocator"]})
    policy = info("policy", "The eviction policy of each tier, and the write policy "
                            "(tier=\"write\").", ("tier",))
    for tier, name in stats["policies"].items():
        policy.add_metric([tier], {"policy": name})
    gauge("uptime_seconds", "Seconds since the daemon started.").add_metric([], stats["uptime_s"])

    capacity = gauge("tier_capacity_bytes", "Capacity of each local tier.", ("tier",))
    used = gauge("tier_used_bytes", "Bytes of each local tier holding pages.", ("tier",))
    pages = gauge("tier_pages", "Pages held in each local tier.", ("tier",))
    lookups = counter("tier_lookups", "Lookups that reached each tier (hits + misses).",
                      ("tier",))
    tier_counters = [(field, counter(name, doc, ("tier",))) for field, name, doc in _TIER_COUNTERS]
    remote = stats.get("remote")
    for tier in stats["tiers"]:
        label = [tier["tier"]]
        capacity.add_metric(label, tier["capacity_bytes"])
        used.add_metric(label, tier["used_bytes"])
        pages.add_metric(label, tier["num_pages"])
        lookups.add_metric(label, tier["hits"] + tier["misses"])
        for field, family in tier_counters:
            family.add_metric(label, tier[field])
    if remote:
        lookups.add_metric(["remote"], remote["hits"] + remote["misses"])
        for field, family in tier_counters:
            if field in remote:
                family.add_metric(["remote"], remote[field])

    counters = stats["counters"]
    for field, name, doc in _STORE_COUNTERS:
        counter(name, doc).add_metric([], counters[field])

    lane_bytes = counter("lane_bytes", "Bytes moved between clients' pools and the tiers, per "
                                       "lane (store: into the tiers, recall: out).", ("lane",))
    lane_busy = counter("lane_busy_seconds", "Seconds each lane spent copying.", ("lane",))
    for lane, figures in stats["lanes"].items():
        lane_bytes.add_metric([lane], figures["bytes"])
        lane_busy.add_metric([lane], figures["busy_s"])
    engine_labels = ("engine", "direction")
    engine_bytes = counter("engine_lane_bytes", "Bytes each transfer engine lane moved "
                                                "(direction d2h: store, h2d: recall).",
                           engine_labels)
    engine_ticks = counter("engine_lane_ticks", "Batches each transfer engine lane ran.",
                           engine_labels)
    engine_busy = counter("engine_lane_busy_seconds", "Seconds each transfer engine lane spent "
                                                      "copying.", engine_labels)
    for engine, directions in stats["engines"].items():
        for direction, figures in directions.items():
            engine_bytes.add_metric([engine, direction], figures["bytes"])
            engine_ticks.add_metric([engine, direction], figures["ticks"])
            engine_busy.add_metric([engine, direction], figures["busy_s"])

    _add_latency(stats, out)

    gauge("jobs_in_flight", "Requests being answered off the event loop now (copies, disk "
                            "I/O, remote round trips).").add_metric([], stats["jobs_in_flight"])
    clients = stats["clients"]
    gauge("clients", "Clients connected now.").add_metric([], len(clients))
    gauge("pools", "Page pools clients have registered.").add_metric(
        [], sum(c["pools"] for c in clients))
    gauge("leases", "Live leases (pins with a time limit).").add_metric([], stats["num_leases"])
    gauge("namespaces", "Namespaces the daemon knows.").add_metric([], stats["num_namespaces"])
    counter("index_keys_refused", "Held keys the lookup plane's indexes refused (their index "
                                  "groups full): clients' local lookups miss them.").add_metric(
        [], stats["index_keys_refused"])

    _add_remote(remote, gauge, counter, info, out)
    return out


def _add_latency(stats: dict, out: list[Metric]) -> None:
    histogram = HistogramMetricFamily("kvtier_request_duration_seconds",
                                      "Time to answer each request, per verb, since start.",
                                      labels=["verb"])
    # A summary: its quantiles are of a sliding window (the last LATENCY_WINDOW requests, what
    # kvtier stats shows), its count and sum cumulative, as Prometheus's summaries are.
    recent = Metric("kvtier_request_recent_duration_seconds",
                    f"Percentiles of the last {LATENCY_WINDOW} requests' answer times per verb "
                    f"(what kvtier stats shows); count and sum since start.", "summary")
    out.extend((histogram, recent))
    name = recent.name
    bounds = [_bound_label(b) for b in stats["latency_buckets_s"]] + ["+Inf"]
    for verb, figures in sorted(stats["latency"].items()):
        if "bucket_counts" not in figures:
            continue
        recent.add_sample(name, {"verb": verb, "quantile": "0.5"}, figures["p50_us"] / 1e6)
        recent.add_sample(name, {"verb": verb, "quantile": "0.99"}, figures["p99_us"] / 1e6)
        recent.add_sample(f"{name}_count", {"verb": verb}, figures["total"])
        recent.add_sample(f"{name}_sum", {"verb": verb}, figures["sum_s"])
        cumulative, buckets = 0, []
        for bound, count in zip(bounds, figures["bucket_counts"], strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        histogram.add_metric([verb], buckets, figures["sum_s"])


def _bound_label(bound_s: float) -> str:
    return repr(float(bound_s))  # what prometheus_client's own Histogram writes: "1e-05", "0.5"


def _add_remote(remote: dict | None, gauge: Callable[..., GaugeMetricFamily],
                counter: Callable[..., CounterMetricFamily],
                info: Callable[..., InfoMetricFamily], out: list[Metric]) -> None:
    remote_info = info("remote", "The remote tier's URL (password removed); absent without one.")
    connected = gauge("remote_connected", "1 while the remote tier answers, 0 while it is "
                                          "offline (local tiers serve alone).")
    budget = gauge("remote_budget_bytes", "Bytes this node may have on the remote tier at "
                                          "once; 0: no cap.")
    held = gauge("remote_held_bytes", "Bytes this node has written to the remote tier and not "
                                      "deleted.")
    pending = gauge("remote_pending_bytes", "Bytes queued for the remote tier, not yet sent.")
    round_trip = Metric("kvtier_remote_round_trip_seconds",
                        "Percentiles of recent remote round trips.", "summary")
    out.append(round_trip)
    remote_counters = [(field, counter(name, doc)) for field, name, doc in _REMOTE_COUNTERS]
    if not remote:
        return
    remote_info.add_metric([], {"url": remote["url"]})
    connected.add_metric([], 1 if remote["connected"] else 0)
    budget.add_metric([], remote["budget_bytes"])
    held.add_metric([], remote["written_bytes"])
    pending.add_metric([], remote["pending_bytes"])
    round_trip.add_sample(round_trip.name, {"quantile": "0.5"}, remote["p50_ms"] / 1e3)
    round_trip.add_sample(round_trip.name, {"quantile": "0.99"}, remote["p99_ms"] / 1e3)
    for field, family in remote_counters:
        family.add_metric([], remote[field])


class _StatsCollector(Collector):
    """Yields `families(snapshot())` on each scrape; nothing before the daemon is serving."""

    def __init__(self) -> None:
        self.snapshot: Callable[[], dict] | None = None

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        if snapshot is None:
            return
        try:
            stats = snapshot()
        except Exception as exc:  # the loop did not answer in time, or the daemon is stopping
            # A scrape without kvtier's series (a gap on the dashboards), not a traceback on
            # stderr from the HTTP server, which would break JSON logs.
            log.warning("metrics scrape without kvtier figures: no stats snapshot (%s: %s)",
                        type(exc).__name__, exc)
            return
        yield from families(stats)


class MetricsEndpoint:
    """The HTTP server Prometheus scrapes: `/metrics` (any path answers the same)."""

    def __init__(self, registry: CollectorRegistry, collector: _StatsCollector, address: str,
                 port: int) -> None:
        self._registry = registry
        self._collector = collector
        self.address = address
        self.port = port
        self._server: ScrapeServer | None = None
        # The last rendering and when it began: scrapes that arrive while one is rendered share
        # the next, so looping scrapers cost one snapshot at a time, not one each.
        self._render_lock = threading.Lock()
        self._rendered: tuple[float, bytes] = (float("-inf"), b"")

    def _render(self) -> tuple[bytes, str]:
        """The exposition text; on a scrape thread, never on the daemon's event loop."""
        received_s = time.monotonic()
        with self._render_lock:
            if self._rendered[0] < received_s:
                started_s = time.monotonic()
                self._rendered = (started_s, generate_latest(self._registry))
            return self._rendered[1], CONTENT_TYPE_LATEST

    @classmethod
    def bind(cls, address: str, port: int) -> MetricsEndpoint:
        """Listen on `address`:`port` now; scrapes show process figures until `serve`.

        Raises:
            ConfigError: the port is taken, or the address cannot be bound (the message says
                which and what to change).
        """
        registry = CollectorRegistry(auto_describe=False)
        collector = _StatsCollector()
        registry.register(collector)
        ProcessCollector(registry=registry)
        endpoint = cls(registry, collector, address, port)
        try:
            server = ScrapeServer(address, port, endpoint._render)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"metrics port {port} on {address} is taken by another "
                                  f"process; choose another --metrics-port") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"metrics port {port} on {address}: permission denied (ports "
                                  f"below 1024 need privileges); choose a port of 1024 or "
                                  f"more") from None
            raise ConfigError(f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}; "
                              f"check metrics.address") from None
        endpoint._server = server
        server.serve_in_thread()
        return endpoint

    def serve(self, snapshot: Callable[[], dict], fd_budget: FdBudget | None = None) -> None:
        """From now on, scrapes show the figures `snapshot()` returns (a `Service.stats()` dict),
        each connection holding one of `fd_budget`'s descriptors."""
        if self._server is not None:
            self._server.fd_budget = fd_budget
        self._collector.snapshot = snapshot

    @property
    def url(self) -> str:
        """Where Prometheus scrapes."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving; a scrape in progress finishes first (idempotent)."""
        if self._server is None:
            return
        self._collector.snapshot = None
        self._server.close()
        self._server = None
