"""`kvtier replay-family`: every policy on every trace of the family, as fractions of OPT."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.policies import POLICY_NAMES
from kvtier.replay.trace_family import (
    BASELINE_POLICY,
    FAMILY_CAPACITIES,
    FamilyCell,
    PolicySummary,
    evaluate,
    family_members,
    summarize,
)


def _names(text: str, known: list[str] | tuple[str, ...], what: str, hint: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise click.BadParameter(f"unknown {what} {', '.join(map(repr, unknown)) or '(none)'}; "
                                 f"choose from {', '.join(known)}", param_hint=hint)
    return names


@click.command("replay-family")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="The Mooncake conversation trace (default: found in "
                                 "$KVTIER_TRACES, the repository's traces/ or ../shared/traces).")
@click.option("--policies", "policy_text", default=",".join(POLICY_NAMES), show_default=True,
              help="Comma-separated host policies to compare.")
@click.option("--capacities", "capacity_text", default=",".join(FAMILY_CAPACITIES),
              show_default=True, help="Host capacities, shares of each trace's distinct pages.")
@click.option("--only", "member_text", default=None,
              help="Comma-separated family members to replay (default all; see --list).")
@click.option("--list", "list_members", is_flag=True, help="List the family's traces and exit.")
@click.option("--jobs", "num_workers", type=click.IntRange(1), default=min(2, os.cpu_count() or 1),
              show_default=True, help="Worker processes (they run under nice 10).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def replay_family(trace: Path | None, policy_text: str, capacity_text: str,
                  member_text: str | None, list_members: bool, num_workers: int,
                  as_json: bool) -> None:
    """Replay every host policy on every trace of the family, beside Belady's OPT.

    The family: the Mooncake conversation trace and its halves (when found), the synthetic
    conversations with the tests' three presets, and seeded generated traffic (RAG over a
    shared document set, agent loops, short chats, prompt bursts, a mix; see
    kvtier/replay/workloads.py). Each cell is a policy's block hit ratio as a fraction of OPT's for
    the same capacity (one host tier, no disk). The summary gives each policy's geometric mean
    and worst case over the cells, and its worst margin against LRU in fractions of OPT. A full
    run replays about 200 traces and takes some minutes on two cores.
    """
    members = family_members(trace)
    if list_members:
        click.echo("\n".join(members))
        return
    policies = _names(policy_text, POLICY_NAMES, "policy", "--policies")
    if member_text is not None:
        members = _names(member_text, members, "trace", "--only")
    capacities = [part.strip() for part in capacity_text.split(",") if part.strip()]
    if not capacities or not all(c.endswith("%") and c[:-1].replace(".", "", 1).isdigit()
                                 and 0 < float(c[:-1]) <= 100 for c in capacities):
        raise click.BadParameter(f"expected shares such as 1%,5%,25%, got {capacity_text!r}",
                                 param_hint="--capacities")
    console = Console(stderr=True)
    num_jobs = len(members) * len(capacities) * (len(policies) + 1)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying the family", total=num_jobs)
        cells = evaluate(policies, members, capacities, trace=trace, num_workers=num_workers,
                         on_done=lambda: progress.advance(task))
    summaries = summarize(cells, policies)
    if as_json:
        click.echo(json.dumps({"policies": policies, "capacities": capacities,
                               "cells": [_cell_json(cell, policies) for cell in cells],
                               "summary": {s.policy: asdict(s) for s in summaries}}))
        return
    Console().print(_table(cells, summaries, policies))


def _cell_json(cell: FamilyCell, policies: list[str]) -> dict:
    data = asdict(cell)
    data["opt_fraction"] = {policy: cell.opt_fraction(policy) for policy in policies}
    return data


def _table(cells: list[FamilyCell], summaries: list[PolicySummary], policies: list[str]) -> Table:
    table = Table(title="host hit ratio as a fraction of Belady's OPT (best of each row bold)")
    table.add_column("trace")
    table.add_column("C", justify="right")
    table.add_column("OPT %", justify="right")
    for policy in policies:
        table.add_column(policy, justify="right")
    for cell in cells:
        fractions = [cell.opt_fraction(policy) for policy in policies]
        best = max(fractions)
        table.add_row(cell.trace, cell.capacity, f"{100 * cell.opt_hit_ratio:.2f}",
                      *(f"[bold]{f:.3f}[/bold]" if f == best else f"{f:.3f}" for f in fractions))
    table.add_section()
    table.add_row("geometric mean", "", "", *(f"{s.geometric_mean:.3f}" for s in summaries))
    table.add_row("worst", "", "", *(f"{s.worst:.3f}" for s in summaries))
    if BASELINE_POLICY in policies:
        table.add_row(f"worst minus {BASELINE_POLICY}", "", "",
                      *(f"{s.worst_against_lru:+.3f}" for s in summaries))
    return table
