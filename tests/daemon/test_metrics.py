"""Prometheus metrics of a real daemon, scraped over HTTP and parsed with prometheus_client's
parser.

The counters move as verbs run (a store, a hit, a miss, an eviction each show), a scrape agrees
with `kvtier stats` (one source), the scrape passes `promtool check metrics` where Debian's
`prometheus` package is installed, and every metric the Grafana dashboard queries is one the
daemon exports. A bad --metrics-port stops the start with one line and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.config import DEFAULT_HOST_POLICY
from kvtier.testing import daemon as harness

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json"
OPERATIONS_GUIDE = Path(__file__).parents[2] / "docs" / "operations.md"
SCRAPE_TIMEOUT_S = 30.0
_METRIC_NAME = re.compile(r"\bkvtier_[A-Za-z0-9_:]+")
# Sample names of a family of each type, from the family's name as the parser reports it.
_SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count", ""), "info": ("_info",)}


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                timeout=SCRAPE_TIMEOUT_S) as reply:
        assert reply.status == 200
        return reply.read().decode()


class Scrape:
    """One parsed scrape: `value(name, **labels)` reads a sample."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                        for f in self.families.values() for s in f.samples}

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]

    def sample_names(self) -> set[str]:
        """Every sample name the daemon exports, including those of families with no sample yet."""
        names = set()
        for family in self.families.values():
            names.update(family.name + suffix
                         for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)))
        return names


@pytest.fixture(scope="module")
def metrics_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, int]]:
    """A daemon (64 MiB host, 256 MiB disk, write-back) serving metrics on a free port."""
    socket_dir = harness.short_socket_dir()
    port = free_port()
    process = harness.DaemonProcess.start(socket_dir / "k.sock",
                                          tmp_path_factory.mktemp("disk") / "disk",
                                          "--metrics-port", str(port))
    try:
        yield process, port
        process.stop_and_check()
    finally:
        if process.running:
            process.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_counters_move_as_verbs_run(metrics_daemon, make_pool) -> None:
    daemon, port = metrics_daemon
    rng = np.random.default_rng(7)
    layout = harness.make_layout("page-first", 64)
    pool = make_pool(layout)
    harness.fill_random(pool, rng, range(16))
    before = Scrape(scrape_text(port))
    with daemon.client() as client:
        handle = pool.register(client, harness.namespace_for(layout, "metrics"))
        keys = harness.random_keys(rng, 16)
        assert client.store(handle, keys, range(16)).result().ok
        after_store = Scrape(scrape_text(port))
        assert client.lookup(handle, keys[:4]).num_prefix == 4
        after_hit = Scrape(scrape_text(port))
        assert client.lookup(handle, harness.random_keys(rng, 1)).num_prefix == 0
        after_miss = Scrape(scrape_text(port))
        harness.Filler(client, pool).overflow_host()
        after_eviction = Scrape(scrape_text(port))
        harness.assert_sound(client)

    def moved(old: Scrape, new: Scrape, name: str, **labels: str) -> float:
        return new.value(name, **labels) - old.value(name, **labels)

    assert moved(before, after_store, "kvtier_stored_pages_total") == 16
    assert (moved(before, after_store, "kvtier_lane_bytes_total", lane="store")
            == 16 * layout.page_bytes)
    assert (moved(before, after_store, "kvtier_tier_used_bytes", tier="host")
            == 16 * layout.page_bytes)
    assert moved(before, after_store, "kvtier_tier_pages", tier="host") == 16
    assert after_store.value("kvtier_request_duration_seconds_count", verb="store") >= 1
    assert moved(after_store, after_hit, "kvtier_tier_hits_total", tier="host") == 4
    assert moved(after_store, after_hit, "kvtier_tier_misses_total", tier="host") == 0
    assert moved(after_hit, after_miss, "kvtier_tier_misses_total", tier="host") == 1
    assert moved(after_hit, after_miss, "kvtier_tier_lookups_total", tier="host") == 1
    assert moved(after_hit, after_miss, "kvtier_request_duration_seconds_count",
                 verb="lookup") == 1
    assert moved(after_miss, after_eviction, "kvtier_tier_evictions_total", tier="host") > 0
    assert moved(after_miss, after_eviction, "kvtier_demotions_total") > 0
    assert after_eviction.value("kvtier_integrity_errors_total") == 0


def test_a_scrape_shows_what_kvtier_stats_shows(metrics_daemon) -> None:
    daemon, port = metrics_daemon
    with daemon.client() as client:
        stats = client.stats()
        scrape = Scrape(scrape_text(port))  # the stats verb changes no counter but its own
        assert scrape.value("kvtier_clients") == len(client.stats()["clients"]) == 1
    for tier in stats["tiers"]:
        for field, name in (("hits", "kvtier_tier_hits_total"),
                            ("misses", "kvtier_tier_misses_total"),
                            ("evictions", "kvtier_tier_evictions_total"),
                            ("used_bytes", "kvtier_tier_used_bytes"),
                            ("capacity_bytes", "kvtier_tier_capacity_bytes"),
                            ("num_pages", "kvtier_tier_pages")):
            assert scrape.value(name, tier=tier["tier"]) == tier[field], (name, tier["tier"])
    for field, value in stats["counters"].items():
        assert scrape.value(_COUNTER_NAMES[field]) == value, field
    for lane, figures in stats["lanes"].items():
        assert scrape.value("kvtier_lane_bytes_total", lane=lane) == figures["bytes"]
    for verb, figures in stats["latency"].items():
        if verb == "stats":
            continue  # the stats call itself came after the snapshot
        assert scrape.value("kvtier_request_duration_seconds_count", verb=verb) == figures["total"]
        assert scrape.value("kvtier_request_duration_seconds_bucket", verb=verb,
                            le="+Inf") == figures["total"]
    for tier, policy in stats["policies"].items():
        assert scrape.value("kvtier_policy_info", tier=tier, policy=policy) == 1
    assert stats["policies"]["host"] == DEFAULT_HOST_POLICY
    assert scrape.value("kvtier_build_info", version=stats["version"],
                        python_allocator=stats["python_allocator"]) == 1
    # Equal, not necessarily 0: a key whose home and spill groups are all full is refused by
    # design (kvtier.key_index), and which groups are full depends on the order keys came and
    # went; this module's tables are small (16 groups at least) and filled near the rebuild load.
    assert scrape.value("kvtier_index_keys_refused_total") == stats["index_keys_refused"]


_COUNTER_NAMES = {
    "pages_stored": "kvtier_stored_pages_total", "pages_recalled": "kvtier_recalled_pages_total",
    "bytes_stored": "kvtier_stored_bytes_total", "bytes_recalled": "kvtier_recalled_bytes_total",
    "promotions": "kvtier_promotions_total", "demotions": "kvtier_demotions_total",
    "demotion_failures": "kvtier_demotion_failures_total",
    "pages_dropped": "kvtier_dropped_pages_total",
    "integrity_errors": "kvtier_integrity_errors_total",
    "store_failures": "kvtier_store_failures_total",
}


def test_histogram_buckets_are_cumulative_and_end_in_the_count(metrics_daemon) -> None:
    _, port = metrics_daemon
    scrape = Scrape(scrape_text(port))
    histogram = scrape.families["kvtier_request_duration_seconds"]
    verbs = {s.labels["verb"] for s in histogram.samples}
    assert verbs  # the fixture's daemon has answered requests by now
    for verb in verbs:
        buckets = [(float(s.labels["le"]), s.value) for s in histogram.samples
                   if s.name.endswith("_bucket") and s.labels["verb"] == verb]
        counts = [count for _, count in sorted(buckets)]
        assert counts == sorted(counts), verb
        assert counts[-1] == scrape.value("kvtier_request_duration_seconds_count", verb=verb)


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is missing (Debian: apt-get install prometheus)")
def test_scrape_passes_promtool_check_metrics(metrics_daemon) -> None:
    _, port = metrics_daemon
    text = scrape_text(port)
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                             capture_output=True, timeout=60)
    assert checked.returncode == 0 and not checked.stdout.strip() + checked.stderr.strip(), \
        checked.stdout + checked.stderr


def dashboard_metric_names() -> set[str]:
    """Every kvtier_* name in the dashboard's PromQL (panel targets and template queries)."""
    document = json.loads(DASHBOARD.read_text())
    expressions = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    expressions.append(value)
                elif key == "query" and isinstance(value, str | dict):
                    expressions.append(value if isinstance(value, str) else value.get("query", ""))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(document)
    return {name for expression in expressions for name in _METRIC_NAME.findall(expression)}


def test_every_metric_the_dashboard_queries_is_exported(metrics_daemon) -> None:
    _, port = metrics_daemon
    exported = Scrape(scrape_text(port)).sample_names()
    queried = dashboard_metric_names()

    assert not queried - exported, f"the dashboard queries unknown metrics: {queried - exported}"
    # What the dashboard is for: hit ratio per tier, bytes per lane, latency percentiles from
    # the histograms, capacity use, remote state.
    assert {"kvtier_tier_hits_total", "kvtier_tier_lookups_total", "kvtier_lane_bytes_total",
            "kvtier_request_duration_seconds_bucket", "kvtier_tier_used_bytes",
            "kvtier_tier_capacity_bytes", "kvtier_remote_connected"} <= queried


def test_the_dashboard_check_tells_a_histogram_from_a_counter(metrics_daemon) -> None:
    _, port = metrics_daemon
    exported = Scrape(scrape_text(port)).sample_names()

    assert "kvtier_request_duration_seconds_bucket" in exported
    assert "kvtier_tier_hits_total" in exported
    assert "kvtier_tier_hits" not in exported  # a counter is queried by its _total name
    assert "kvtier_tier_hits_bucket" not in exported
    assert "kvtier_request_duration_seconds" not in exported


def test_the_operations_guide_lists_every_family_the_daemon_exports(metrics_daemon) -> None:
    _, port = metrics_daemon
    families = Scrape(scrape_text(port)).families.values()
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in families
                if f.name.startswith("kvtier_")}
    rows = re.findall(r"^\| `(kvtier_[a-z0-9_]+)` \|", OPERATIONS_GUIDE.read_text(), re.MULTILINE)

    assert set(rows) == exported


def test_metrics_are_off_by_default_and_on_loopback_when_on(metrics_daemon,
                                                            daemon) -> None:
    with_metrics, port = metrics_daemon
    listening = [c for c in psutil.Process(with_metrics.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert [(c.laddr.ip, c.laddr.port) for c in listening] == [("127.0.0.1", port)]
    assert not psutil.Process(daemon.pid).net_connections("inet")


def test_remote_state_shows_an_offline_remote_tier(make_daemon, socket_dir: Path,
                                                   tmp_path: Path) -> None:
    port = free_port()
    unreachable = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--metrics-port", str(port),
                "--remote-url", unreachable)

    scrape = Scrape(scrape_text(port))

    assert scrape.value("kvtier_remote_connected") == 0
    assert scrape.value("kvtier_remote_outages_total") >= 1
    assert scrape.value("kvtier_remote_info", url=unreachable) == 1


@pytest.mark.parametrize("port, problem", [
    ("taken", "is taken"),
    ("70000", "port 70000 is out of range"),  # the flag's message is the environment's
    ("http", "not a port number: 'http'"),
    ("env:abc", "not a port number: 'abc'"),
    ("env:0", "port 0 is out of range"),
])
def test_a_bad_metrics_port_is_one_clear_error_and_starts_nothing(
        port: str, problem: str, socket_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    holder = socket.socket()
    try:
        args: tuple[str, ...] = ()
        if port == "taken":
            holder.bind(("127.0.0.1", 0))
            holder.listen(1)
            args = ("--metrics-port", str(holder.getsockname()[1]))
        elif port.startswith("env:"):
            monkeypatch.setenv("KVTIER_METRICS_PORT", port.removeprefix("env:"))
        else:
            args = ("--metrics-port", port)
        segments_before = set(os.listdir("/dev/shm"))
        process = harness.DaemonProcess.start(socket_dir / "k.sock", tmp_path / "disk", *args,
                                              wait_ready=False)
        code = process.wait_exit()
    finally:
        holder.close()

    log = process.log()
    assert code != 0, log
    assert problem in log, log
    errors = [line for line in log.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and problem in errors[0], log
    assert "Traceback" not in log
    assert not process.socket_path.exists() and not process.lock_path.exists()
    assert not (tmp_path / "disk").exists()
    left = {name for name in set(os.listdir("/dev/shm")) - segments_before
            if name.startswith(f"kvtier-host-{process.pid}-")}
    assert not left, left


def test_a_scrape_the_daemon_cannot_answer_is_a_gap_and_a_warning_not_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    from kvtier.daemon.metrics import MetricsEndpoint

    def stuck() -> dict:
        raise TimeoutError("the event loop did not answer within 5 s")

    endpoint = MetricsEndpoint.bind("127.0.0.1", free_port())
    try:
        endpoint.serve(stuck)
        scrape = Scrape(scrape_text(endpoint.port))
    finally:
        endpoint.close()

    assert not [name for name in scrape.families if name.startswith("kvtier_")]
    assert "process_cpu_seconds" in scrape.families  # the endpoint itself still answers
    assert "no stats snapshot (TimeoutError" in caplog.text
