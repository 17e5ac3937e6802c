"""`kvtier stats` against a live daemon, and what `kvtier serve` and `kvtier stats` tell a user."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from kvtier.cli.main import main
from kvtier.testing import daemon as harness


def store_and_recall_some_pages(daemon, make_pool) -> None:
    layout = harness.make_layout("page-first", 4)
    pool = make_pool(layout)
    with daemon.client("stats-feeder") as client:
        handle = pool.register(client, harness.namespace_for(layout, "stats-cli"))
        harness.fill_random(pool, np.random.default_rng(40), range(4))
        keys = harness.random_keys(np.random.default_rng(41), 2)
        assert client.store(handle, keys, [0, 1]).result().ok
        assert client.recall(handle, keys, [2, 3]).result().ok


def test_stats_json_prints_one_object_with_every_section(daemon, make_pool) -> None:
    store_and_recall_some_pages(daemon, make_pool)
    kvtier = Path(sys.executable).with_name("kvtier")

    done = subprocess.run([str(kvtier), "stats", "--socket", str(daemon.socket_path), "--json"],
                          capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)  # the whole output is one JSON object
    assert isinstance(stats, dict)
    assert {tier["tier"] for tier in stats["tiers"]} == {"host", "disk"}
    assert stats["lanes"]["store"]["bytes"] >= 2 * harness.PAGE_BYTES
    assert stats["lanes"]["recall"]["bytes"] >= 2 * harness.PAGE_BYTES
    assert {"hello", "register_pool", "store", "recall"} <= set(stats["latency"])
    assert set(stats["latency"]["store"]) == {"count", "p50_us", "p99_us",  # the recent window
                                              "total", "sum_s", "bucket_counts"}  # since start
    assert len(stats["latency"]["store"]["bucket_counts"]) == len(stats["latency_buckets_s"]) + 1
    assert "kvtier stats" in [c["name"] for c in stats["clients"]]


def test_stats_table_shows_tiers_and_request_latency(daemon, make_pool) -> None:
    store_and_recall_some_pages(daemon, make_pool)

    result = CliRunner().invoke(main, ["stats", "--socket", str(daemon.socket_path)])

    assert result.exit_code == 0, result.output
    for title in ("tiers", "traffic", "request latency", "clients ("):
        assert title in result.output
    assert "host" in result.output and "disk" in result.output


def test_stats_without_a_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["stats", "--socket", str(tmp_path / "none.sock")])

    assert result.exit_code != 0
    assert f"no kvtier daemon at {tmp_path / 'none.sock'}" in result.output
    assert "kvtier serve" in result.output


def test_serve_help_mentions_the_environment_variables() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])

    assert result.exit_code == 0
    assert "KVTIER_" in result.output
    assert "--host-capacity" in result.output and "--socket" in result.output


def test_check_reports_a_sound_daemon_and_exits_zero(daemon, make_pool) -> None:
    store_and_recall_some_pages(daemon, make_pool)

    result = CliRunner().invoke(main, ["check", "--socket", str(daemon.socket_path),
                                       "--verify-bytes"])
    assert result.exit_code == 0, result.output
    assert "sound: no problems (disk bytes verified)" in result.output

    as_json = CliRunner().invoke(main, ["check", "--socket", str(daemon.socket_path), "--json"])
    assert json.loads(as_json.stdout) == {"problems": [], "verify_bytes": False}


def test_check_exits_one_and_names_each_problem(daemon, make_pool, monkeypatch) -> None:
    from kvtier.client import Client

    monkeypatch.setattr(Client, "check", lambda self, verify_bytes=False: ["host slot 0 is used "
                                                                           "by two pages"])
    result = CliRunner().invoke(main, ["check", "--socket", str(daemon.socket_path)])
    assert result.exit_code == 1
    assert "problem: host slot 0 is used by two pages" in result.output


def test_check_and_stats_without_a_daemon_exit_3(tmp_path: Path) -> None:
    for command in ("check", "stats"):
        result = CliRunner().invoke(main, [command, "--socket", str(tmp_path / "none.sock")])
        assert result.exit_code == 3, result.output  # not 1: that is "problems found"
        assert "no kvtier daemon at" in result.output


def test_check_usage_error_exits_2() -> None:
    assert CliRunner().invoke(main, ["check", "--verify"]).exit_code == 2


def test_check_help_documents_its_exit_statuses() -> None:
    text = " ".join(CliRunner().invoke(main, ["check", "--help"]).output.split())
    assert "1 problems found" in text and "2 usage error" in text and "3 no daemon" in text


def test_serve_with_more_host_capacity_than_memory_says_gib_and_ram(tmp_path: Path) -> None:
    kvtier = Path(sys.executable).with_name("kvtier")
    done = subprocess.run([str(kvtier), "serve", "--socket", str(tmp_path / "k.sock"),
                           "--disk-path", str(tmp_path / "disk"), "--host-capacity", "1024TiB"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("Error: the host tier does not fit: cannot create a 1024.0 TiB")
    # /dev/shm may be small (64 MiB in a container): any unit, never raw bytes
    assert re.search(r"has [0-9.]+ [KMGT]i?B free; this machine has [0-9.]+ [MGT]iB of RAM", line)
    assert "--host-capacity" in line and "1125899906842624" not in line


def test_stats_watch_into_a_pipe_flushes_each_snapshot_and_an_idle_daemon_has_no_jobs(
        daemon) -> None:
    """`--watch` into a file printed nothing for many seconds (buffered), and an idle daemon
    counted the stats request asking as a job in flight."""
    watcher = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "stats", "--socket", str(daemon.socket_path),
         "--json", "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        snapshots = [json.loads(harness.readline_within(watcher.stdout, 60.0))  # type: ignore[arg-type]
                     for _ in range(2)]
        assert [s["jobs_in_flight"] for s in snapshots] == [0, 0]
    finally:
        watcher.kill()
        watcher.wait(30)
        watcher.stdout.close()  # type: ignore[union-attr]
        watcher.stderr.close()  # type: ignore[union-attr]
