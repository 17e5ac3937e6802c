"""`kvtier stats`: live figures of a running daemon, as tables or JSON."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from kvtier.cli.exit_codes import ExitCode, NoDaemonError
from kvtier.sizes import format_bytes


def _tier_table(stats: dict) -> Table:
    policies = ", ".join(f"{tier} {name}" for tier, name in stats.get("policies", {}).items())
    table = Table(title=f"tiers (policies: {policies})" if policies else "tiers")
    for column in ("tier", "capacity", "used", "pages", "hits", "misses", "hit ratio",
                   "evictions"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    for t in stats["tiers"]:
        table.add_row(t["tier"], format_bytes(t["capacity_bytes"]), format_bytes(t["used_bytes"]),
                      str(t["num_pages"]), str(t["hits"]), str(t["misses"]),
                      f"{t['hit_ratio']:.1%}", str(t["evictions"]))
    remote = stats.get("remote")
    if remote:  # capacity: this node's byte budget; used: what it has written and not deleted
        table.add_row("remote", format_bytes(remote["budget_bytes"]) if remote["budget_bytes"]
                      else "no cap", format_bytes(remote["written_bytes"]),
                      str(remote["pages_written"]), str(remote["hits"]), str(remote["misses"]),
                      f"{remote['hit_ratio']:.1%}", str(remote["pages_expired_by_budget"]))
    return table


def _remote_table(remote: dict) -> Table:
    state = "connected" if remote["connected"] else "OFFLINE (serving local tiers only)"
    table = Table(title=f"remote tier {remote['url']}: {state}")
    for column in ("read", "p50 ms", "p99 ms", "errors", "timeouts", "corrupt",
                   "dropped writes", "outages"):
        table.add_column(column, justify="right")
    table.add_row(format_bytes(remote["bytes_read"]), f"{remote['p50_ms']:.2f}",
                  f"{remote['p99_ms']:.2f}", str(remote["errors"]), str(remote["timeouts"]),
                  str(remote["integrity_errors"]), str(remote["writes_dropped"]),
                  str(remote["outages"]))
    return table


def _traffic_table(stats: dict) -> Table:
    table = Table(title="traffic")
    for column in ("lane", "bytes", "GB/s while copying"):
        table.add_column(column, justify="left" if column == "lane" else "right")
    for lane, figures in stats["lanes"].items():
        table.add_row(lane, format_bytes(figures["bytes"]), f"{figures['gbps']:.2f}")
    for engine, directions in stats.get("engines", {}).items():  # the transfer engines' lanes
        for direction, figures in directions.items():
            table.add_row(f"{direction} ({engine})", format_bytes(figures["bytes"]),
                          f"{figures['gbps']:.2f}")
    return table


def _latency_table(stats: dict) -> Table:
    table = Table(title="request latency")
    for column in ("verb", "count", "p50 µs", "p99 µs"):
        table.add_column(column, justify="left" if column == "verb" else "right")
    for verb, figures in sorted(stats["latency"].items()):
        table.add_row(verb, str(figures["count"]), f"{figures['p50_us']:.0f}",
                      f"{figures['p99_us']:.0f}")
    return table


def _clients_table(stats: dict) -> Table:
    table = Table(title=f"clients ({len(stats['clients'])} attached, "
                        f"{stats.get('jobs_in_flight', 0)} jobs in flight)")
    for column in ("id", "name", "pid", "pools", "leases"):
        table.add_column(column)
    for c in stats["clients"]:
        table.add_row(str(c["client_id"]), c["name"] or "-", str(c["pid"]), str(c["pools"]),
                      str(c["leases"]))
    return table


def render_stats(stats: dict) -> Group:
    """Every table of `kvtier stats`, in reading order."""
    tables = [_tier_table(stats)]
    if stats.get("remote"):
        tables.append(_remote_table(stats["remote"]))
    return Group(*tables, _traffic_table(stats), _latency_table(stats), _clients_table(stats))


@click.command()
@click.option("--socket", "socket_path", type=click.Path(path_type=Path),
              help="The daemon's socket [default: as kvtier serve chooses it].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
@click.option("--watch", type=click.FloatRange(min=0.1), default=None, metavar="SECONDS",
              help="Refresh every SECONDS until Ctrl-C.")
def stats(socket_path: Path | None, as_json: bool, watch: float | None) -> None:
    """Show a running daemon's tiers, traffic, request latency and attached clients.

    Per tier: capacity, used bytes, pages, hits, misses, hit ratio, evictions; for a remote tier
    also whether it is connected, bytes read and written, round-trip latency and errors. Per lane
    (store, recall): bytes moved and GB/s while copying. Per verb: p50 and p99 latency in µs. Exit
    status 3 when no daemon answers on the socket.
    """
    from kvtier.client import Client

    try:
        client = Client(socket_path, client_name="kvtier stats")
    except ConnectionError as exc:
        raise NoDaemonError(str(exc)) from exc
    with client:
        if watch is None:
            figures = client.stats()
            if as_json:
                click.echo(json.dumps(figures))
            else:
                Console().print(render_stats(figures))
            return
        console = Console()
        try:
            if as_json or not console.is_terminal:
                # Into a file or a pipe: one snapshot after another, each flushed as it is
                # printed (a live display there showed nothing until the buffer filled).
                while True:
                    figures = client.stats()
                    if as_json:
                        click.echo(json.dumps(figures))
                    else:
                        console.print(render_stats(figures))
                    sys.stdout.flush()
                    time.sleep(watch)  # the refresh period the user asked for
            with Live(render_stats(client.stats()), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(watch)
                    live.update(render_stats(client.stats()))
        except KeyboardInterrupt:
            pass


@click.command()
@click.option("--socket", "socket_path", type=click.Path(path_type=Path),
              help="The daemon's socket [default: as kvtier serve chooses it].")
@click.option("--verify-bytes", is_flag=True,
              help="Also read every disk page and verify its header and checksum (slower).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def check(socket_path: Path | None, verify_bytes: bool, as_json: bool) -> None:
    """Run a running daemon's integrity walk; exit 1 when it finds problems, 3 without a daemon.

    Checks that every slot belongs to one page, slot accounting and policies agree with the page
    table, and the disk index names exactly the pages on disk; with --verify-bytes, every disk
    page's bytes too.

    \b
    Exit status: 0 sound; 1 problems found (each printed); 2 usage error; 3 no daemon on the
    socket.
    """
    from kvtier.client import Client

    try:
        client = Client(socket_path, client_name="kvtier check")
    except ConnectionError as exc:
        raise NoDaemonError(str(exc)) from exc
    with client:
        problems = client.check(verify_bytes=verify_bytes)
    if as_json:
        click.echo(json.dumps({"problems": problems, "verify_bytes": verify_bytes}))
    elif problems:
        for problem in problems:
            click.echo(f"problem: {problem}")
    else:
        click.echo("sound: no problems" + (" (disk bytes verified)" if verify_bytes else ""))
    if problems:
        raise SystemExit(ExitCode.PROBLEMS)
