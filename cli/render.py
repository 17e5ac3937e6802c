"""Human output of the CLI: rich tables, progress bars and JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.sizes import format_bytes
from kvtier.stats import StoreStats


def tier_table(stats: StoreStats, title: str = "tiers") -> Table:
    """Per tier capacity, occupancy, hits and traffic."""
    table = Table(title=title)
    for column in ("tier", "capacity", "used", "pages", "hits", "misses", "hit ratio",
                   "evictions", "written", "read"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    for t in stats.tiers:
        table.add_row(t.tier, format_bytes(t.capacity_bytes), format_bytes(t.used_bytes),
                      str(t.num_pages), str(t.hits), str(t.misses), f"{t.hit_ratio:.1%}",
                      str(t.evictions), format_bytes(t.bytes_written), format_bytes(t.bytes_read))
    return table


def counters_table(stats: StoreStats) -> Table:
    """Store-wide counters, one per row."""
    table = Table(title="store")
    table.add_column("counter")
    table.add_column("value", justify="right")
    for name, value in asdict(stats.counters).items():
        shown = format_bytes(value) if name.startswith("bytes_") else str(value)
        table.add_row(name.replace("_", " "), shown)
    return table


def render_demo(store, run_demo: Callable, num_requests: int, seed: int, as_json: bool):  # noqa: ANN001
    """Run the demo with a progress bar (unless JSON) and print its report and the store's stats."""
    console = Console(stderr=as_json)
    with Progress(console=console, transient=True, disable=as_json) as progress:
        task = progress.add_task("demo requests", total=num_requests)
        report = run_demo(store, num_requests, seed,
                          on_request=lambda _: progress.advance(task))
    stats = store.stats()
    if as_json:
        print(json.dumps({"demo": asdict(report), "stats": stats.to_dict()}))
        return report
    console.print(tier_table(stats))
    console.print(counters_table(stats))
    console.print(
        f"{report.num_requests} requests, {report.pages_requested} pages asked, "
        f"{report.pages_reused} reused ({report.pages_reused / max(1, report.pages_requested):.1%}), "
        f"{report.pages_verified} recalled pages verified byte for byte, "
        f"{report.wrong_pages} wrong, in {report.elapsed_s:.2f} s"
    )
    return report
