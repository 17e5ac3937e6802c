"""The `kvtier` command line: `kvtier version`, `kvtier demo`, and more as the daemon grows."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import click

from kvtier import __version__
from kvtier.cli.params import BYTES
from kvtier.cli.replay import replay
from kvtier.cli.serve import serve
from kvtier.cli.stats import stats
from kvtier.errors import KvtierError




@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="kvtier")
def main() -> None:
    """kvtier: a per-node KV-cache memory manager for LLM inference.

    kvtier keeps engines' attention KV pages across tiers (GPU HBM, pinned host DRAM, NVMe)
    so prefixes computed once are reused instead of recomputed.

    \b
    Start here:
      kvtier serve       run the daemon engines attach to (see kvtier serve --help)
      kvtier stats       live figures of a running daemon: tiers, traffic, latency, clients
      kvtier demo        run the page store with its default configuration on a demo workload
      kvtier version     print the version
    """


@main.command()
def version() -> None:
    """Print kvtier's version."""
    click.echo(f"kvtier {__version__}")


@main.command()
@click.option("--requests", "num_requests", default=48, show_default=True, type=click.IntRange(1),
              help="Chat requests to run through the store.")
@click.option("--host-capacity", type=BYTES, default="256MiB", show_default=True,
              help="Host tier size; small by default so the demo shows pages cascading to disk.")
@click.option("--disk-capacity", type=BYTES, default="2GiB", show_default=True,
              help="Disk tier cap.")
@click.option("--disk-path", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Disk tier directory (kept afterwards). Default: a temporary directory.")
@click.option("--seed", default=0, show_default=True, help="Workload seed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def demo(num_requests: int, host_capacity: int, disk_capacity: int, disk_path: Path | None,
         seed: int, as_json: bool) -> None:
    """Run the page store on a seeded chat workload and print tier stats.

    Requests share system prompts and continue earlier conversations; each one looks up its
    prefix, recalls (and verifies, byte for byte) the pages kvtier holds, and stores the rest.
    Everything else is the default configuration: LRU in both tiers, write-back to disk.
    """
    from kvtier.cli.render import render_demo
    from kvtier.config import DiskConfig, HostConfig, StoreConfig
    from kvtier.demo import run_demo
    from kvtier.store import PageStore

    scratch = None
    if disk_path is None:
        scratch = Path(tempfile.mkdtemp(prefix="kvtier-demo-"))
        disk_path = scratch / "disk"
    try:
        config = StoreConfig(host=HostConfig(capacity_bytes=host_capacity),
                             disk=DiskConfig(path=disk_path, capacity_bytes=disk_capacity))
        with PageStore(config) as store:
            report = render_demo(store, run_demo, num_requests, seed, as_json)
            problems = store.check()
    except KvtierError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if problems or report.wrong_pages:
        click.echo(f"integrity check failed: {problems[:5]} wrong pages: {report.wrong_pages}",
                   err=True)
        sys.exit(1)


for _command in (serve, stats, replay):
    main.add_command(_command)

if __name__ == "__main__":
    main()
