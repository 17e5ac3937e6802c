"""The remote tier in Prometheus metrics: two real daemons sharing one real Redis, scraped over
HTTP. Node a's writes and node b's remote hits show, and both report the tier connected."""

from __future__ import annotations

import socket
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvtier.testing import daemon as harness

NUM_PAGES = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_remote_writes_hits_and_state_show_in_both_nodes_scrapes(redis_server, make_daemon,
                                                                  make_pool, socket_dir, tmp_path):
    ports = {"a": free_port(), "b": free_port()}
    nodes = {name: make_daemon(socket_dir / f"{name}.sock", tmp_path / name / "disk",
                               "--remote-url", redis_server.url, "--metrics-port", str(port))
             for name, port in ports.items()}
    layout = harness.make_layout("page-first", NUM_PAGES)
    namespace = harness.namespace_for(layout, "shared-model")
    rng = np.random.default_rng(5)
    keys = harness.random_keys(rng, NUM_PAGES)
    pool_a, pool_b = make_pool(layout), make_pool(layout)
    harness.fill_random(pool_a, rng, range(NUM_PAGES))
    with nodes["a"].client("a") as client_a, nodes["b"].client("b") as client_b:
        handle_a = pool_a.register(client_a, namespace)
        assert client_a.store(handle_a, keys, range(NUM_PAGES)).result().ok
        harness.wait_until(
            lambda: scrape(ports["a"])[("kvtier_remote_written_pages_total", ())] == NUM_PAGES
            and scrape(ports["a"])[("kvtier_remote_pending_bytes", ())] == 0, "node a's writes")
        handle_b = pool_b.register(client_b, namespace)
        assert client_b.lookup(handle_b, keys).num_prefix == NUM_PAGES

    a, b = scrape(ports["a"]), scrape(ports["b"])
    assert a[("kvtier_remote_connected", ())] == b[("kvtier_remote_connected", ())] == 1
    assert a[("kvtier_remote_held_bytes", ())] >= NUM_PAGES * layout.page_bytes
    assert b[("kvtier_tier_hits_total", (("tier", "remote"),))] == NUM_PAGES
    assert (b[("kvtier_tier_read_bytes_total", (("tier", "remote"),))]
            >= NUM_PAGES * layout.page_bytes)
    assert b[("kvtier_remote_errors_total", ())] == 0
    assert b[("kvtier_remote_integrity_errors_total", ())] == 0
