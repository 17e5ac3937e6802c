"""The `kvtier` command line: serve, stats, demo, replay, version."""

from __future__ import annotations

import importlib

import click

from kvtier import __version__

# Each command's module is imported only when that command runs: together they import numpy,
# the store and the replayer, ~0.4 s of CPU that `kvtier --help` or `kvtier stats` never needs.
COMMAND_MODULES = {"serve": ("kvtier.cli.serve", "serve"), "stats": ("kvtier.cli.stats", "stats"),
                   "check": ("kvtier.cli.stats", "check"), "demo": ("kvtier.cli.demo", "demo"),
                   "replay": ("kvtier.cli.replay", "replay"),
                   "replay-family": ("kvtier.cli.replay_family", "replay_family")}


class LazyCommands(click.Group):
    """A group whose commands load on first use; its help lists them from its docstring."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMAND_MODULES})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMAND_MODULES:
            module, name = COMMAND_MODULES[cmd_name]
            command: click.Command = getattr(importlib.import_module(module), name)
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Nothing: the docstring's "Start here" lists every command, and a listing here would
        import them all for their one-line helps."""


@click.group(cls=LazyCommands,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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


if __name__ == "__main__":
    main()
