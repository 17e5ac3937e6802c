"""`kvtier replay`: hit ratios of the store's policies on a request trace, beside Belady's OPT."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.params import BYTES
from kvtier.cli.progress import Steps, phase
from kvtier.cli.replay_plot import (
    PLOT_CAPACITIES,
    PLOT_POLICIES,
    OptJob,
    default_num_processes,
    draw_plot,
    plot_curves,
    require_matplotlib,
    run_jobs,
)
from kvtier.config import DEFAULT_HOST_POLICY, WritePolicy, check_policy
from kvtier.errors import ConfigError, KvtierError
from kvtier.policies import POLICY_NAMES
from kvtier.replay.replayer import (
    DEFAULT_PAGE_TOKENS,
    ReplayConfig,
    ReplayResult,
    TraceRequest,
    count_distinct_pages,
    opt_hit_ratio,
    parse_capacity,
    read_trace,
)
from kvtier.replay.replayer import replay as run_replay
from kvtier.sizes import format_bytes

CAPACITY_FORMS = ("pages (9140), a share of the trace's distinct pages (5%), or bytes (64GiB, "
                  "divided by --page-bytes)")


def _policies_by_tier(spec: str | None, host: str | None, disk: str | None) -> tuple[str, str]:
    host_policy, disk_policy = DEFAULT_HOST_POLICY, "lru"
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        tier, sep, name = part.partition("=")
        if not sep:
            host_policy = tier.strip()
        elif tier.strip() == "host":
            host_policy = name.strip()
        elif tier.strip() == "disk":
            disk_policy = name.strip()
        else:
            raise click.BadParameter(f"unknown tier {tier!r}: use host=NAME,disk=NAME",
                                     param_hint="--policy")
    host_policy, disk_policy = host or host_policy, disk or disk_policy
    try:
        return check_policy(host_policy), check_policy(disk_policy)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None


@click.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--policy", "policy_spec", default=None,
              help="Policies per tier: NAME (host), or host=NAME,disk=NAME. "
                   f"Known: {', '.join(POLICY_NAMES)}. "
                   f"Default: host {DEFAULT_HOST_POLICY}, disk lru.")
@click.option("--host-policy", default=None, help="Host tier policy (overrides --policy).")
@click.option("--disk-policy", default=None, help="Disk tier policy (overrides --policy).")
@click.option("--host-capacity", default="5%", show_default=True,
              help=f"Host tier size: {CAPACITY_FORMS}.")
@click.option("--disk-capacity", default="0", show_default=True,
              help="Same forms as --host-capacity; 0 replays without a disk tier.")
@click.option("--write-policy", type=click.Choice([p.value for p in WritePolicy]),
              default=WritePolicy.WRITE_BACK.value, show_default=True,
              help="When pages reach disk.")
@click.option("--page-tokens", default=DEFAULT_PAGE_TOKENS, show_default=True,
              type=click.IntRange(1), help="Tokens per page of the trace's hash_ids.")
@click.option("--page-bytes", type=BYTES, default="1MiB", show_default=True,
              help="Bytes per page: converts byte capacities and reports traffic.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also draw host hit ratio against capacity "
                                 f"({', '.join(PLOT_CAPACITIES)}) for {', '.join(PLOT_POLICIES)}, "
                                 "the chosen policy and OPT into this PNG (needs matplotlib; "
                                 "its replays run in --jobs processes).")
@click.option("--jobs", "num_processes", type=click.IntRange(1), default=None,
              help="Processes for --plot's replays [default: the CPUs this process may use].")
def replay_command(trace: Path, policy_spec: str | None, host_policy: str | None,
                   disk_policy: str | None, host_capacity: str, disk_capacity: str,
                   write_policy: str, page_tokens: int, page_bytes: int, as_json: bool,
                   plot_path: Path | None, num_processes: int | None) -> None:
    """Replay a request trace through the store's page table, tiers and policies.

    TRACE is JSONL in the Mooncake format: one request a line with `timestamp` (ms),
    `input_length`, `output_length` and `hash_ids` (chained prefix page ids). The store runs in
    metadata-only mode (no page bytes). Each request looks its pages up (hits, and prefix hits:
    the leading run an engine can reuse), recalls the present ones (a disk hit is promoted to
    host) and stores its missing pages. A request's partly filled last page is looked up (it
    counts as a reference) but never stored: engines store whole pages only. OPT is Belady's
    offline optimum for one tier of the host capacity (plus the disk's, when there is one),
    with the same storing rule.
    """
    host_policy, disk_policy = _policies_by_tier(policy_spec, host_policy, disk_policy)
    if plot_path is not None:
        require_matplotlib()  # before the replay, not after it
    try:
        requests = read_trace(trace)  # seconds at most: its errors stay the only line
    except KvtierError as exc:
        raise click.ClickException(str(exc)) from exc
    num_distinct = count_distinct_pages(requests)
    host_pages = _capacity(host_capacity, "--host-capacity", num_distinct, page_bytes)
    if host_pages < 1:
        raise click.BadParameter(
            f"{host_capacity} is no whole page of this trace ({num_distinct} distinct pages, "
            f"{format_bytes(page_bytes)} each); the host tier needs at least one",
            param_hint="--host-capacity")
    try:
        config = ReplayConfig(
            host_pages=host_pages, host_policy=host_policy,
            disk_pages=_capacity(disk_capacity, "--disk-capacity", num_distinct, page_bytes),
            disk_policy=disk_policy, write_policy=WritePolicy(write_policy),
            page_tokens=page_tokens, page_bytes=page_bytes)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    console = Console(stderr=as_json)
    if plot_path is None:
        with Steps(console, f"replaying {trace.name}", len(requests), quiet=as_json) as steps:
            result = run_replay(requests, config, on_request=lambda _: steps.advance())
        with phase(console, "computing Belady's OPT", quiet=as_json):
            opt = opt_hit_ratio(requests, config.host_pages + config.disk_pages, page_tokens)
    else:
        result, opt = _replay_and_plot(requests, config, num_distinct, plot_path,
                                       num_processes or default_num_processes(), console,
                                       as_json, trace.name)
    if as_json:
        data = _to_json(result, config, num_distinct, opt)
        if plot_path is not None:
            data["plot_path"] = str(plot_path.resolve())
        click.echo(json.dumps(data))
    else:
        console.print(_result_table(result, config, opt))
        console.print(
            f"{result.num_requests} requests, {result.num_references} page references, "
            f"{num_distinct} distinct pages; disk written "
            f"{format_bytes(result.bytes_written_disk)}, promoted "
            f"{format_bytes(result.bytes_promoted)} ({result.pages_promoted} pages), "
            f"demoted {result.pages_demoted} pages")
    if plot_path is not None:
        # Unwrapped and unstyled: a path to copy.
        console.print(f"plot written to {plot_path.resolve()}", soft_wrap=True, highlight=False)


def _capacity(text: str, option: str, num_distinct: int, page_bytes: int) -> int:
    try:
        return parse_capacity(text, num_distinct, page_bytes)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from exc


def _replay_and_plot(requests: list[TraceRequest], config: ReplayConfig, num_distinct: int,
                     path: Path, num_processes: int, console: Console, quiet: bool,
                     trace_name: str) -> tuple[ReplayResult, float]:
    capacities, curves = plot_curves(config, num_distinct)
    own_opt = OptJob(config.host_pages + config.disk_pages, config.page_tokens)
    jobs = [config, own_opt, *(job for points in curves.values() for job in points)]
    with Steps(console, f"replaying {trace_name} for the plot ({num_processes} processes)",
               len(set(jobs)), quiet=quiet) as steps:
        done = run_jobs(requests, jobs, num_processes, on_done=steps.advance)
    ratios = {name: [_hit_ratio(done[job]) for job in points] for name, points in curves.items()}
    draw_plot(path, capacities, num_distinct, ratios)
    result, opt_ratio = done[config], done[own_opt]
    assert isinstance(result, ReplayResult) and isinstance(opt_ratio, float)  # see run_jobs
    return result, opt_ratio


def _hit_ratio(done: ReplayResult | float) -> float:
    """A job's host block hit ratio: a replay's, or OPT's (which is all its job returns)."""
    return done if isinstance(done, float) else done.block_hit_ratio


def _to_json(result: ReplayResult, config: ReplayConfig, num_distinct: int, opt: float) -> dict:
    data = asdict(result)
    data["tiers"] = {t["tier"]: t for t in data["tiers"]}
    data.update(host_pages=config.host_pages, disk_pages=config.disk_pages,
                host_policy=config.host_policy, disk_policy=config.disk_policy,
                write_policy=config.write_policy.value, num_distinct_pages=num_distinct,
                opt_block_hit_ratio=opt,
                opt_fraction=result.block_hit_ratio / opt if opt else 0.0)
    return data


def _result_table(result: ReplayResult, config: ReplayConfig, opt: float) -> Table:
    table = Table(title=f"replay: host {config.host_policy} ({config.host_pages} pages)"
                  + (f" over disk {config.disk_policy} ({config.disk_pages} pages)"
                     if config.disk_pages else ""))
    for column in ("tier", "hits", "block hit ratio", "prefix hit ratio"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    for tier in result.tiers:
        table.add_row(tier.tier, str(tier.hits), f"{tier.block_hit_ratio:.2%}",
                      f"{tier.prefix_hit_ratio:.2%}")
    table.add_row("total", str(result.hits), f"{result.block_hit_ratio:.2%}",
                  f"{result.prefix_hit_ratio:.2%}")
    share = result.block_hit_ratio / opt if opt else 0.0
    table.add_row("Belady OPT", "", f"{opt:.2%}", f"(online/OPT {share:.2f})")
    return table


replay = replay_command
