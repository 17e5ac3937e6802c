"""The `kvtier` command line: serve, stats, demo, replay, version."""

from __future__ import annotations

import click

from kvtier import __version__
from kvtier.cli.demo import demo
from kvtier.cli.replay import replay
from kvtier.cli.replay_family import replay_family
from kvtier.cli.serve import serve
from kvtier.cli.stats import check, stats


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
      kvtier check       a running daemon's integrity walk (exit 1 on problems, 3: no daemon)
      kvtier demo        start the daemon, run a small model (or page workload) through it
      kvtier replay      replay a request trace to compare eviction policies against Belady
      kvtier replay-family  every policy on a family of traces: fractions of OPT, worst cases
      kvtier version     print the version

    \b
    Exit status, every command: 0 done; 1 problems found or a failure (a bad trace, a daemon
    that cannot start with right settings); 2 usage error (a bad flag, value or argument, and a
    bad setting in the environment or a config file alike); 3 no daemon answers (stats, check).
    """


@main.command()
def version() -> None:
    """Print kvtier's version."""
    click.echo(f"kvtier {__version__}")


for _command in (serve, stats, check, demo, replay, replay_family):
    main.add_command(_command)

if __name__ == "__main__":
    main()
