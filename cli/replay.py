"""`kvtier replay`: hit ratios of the store's policies on a request trace, beside Belady's OPT."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.config import DEFAULT_HOST_POLICY, WritePolicy
from kvtier.errors import KvtierError
from kvtier.policies import POLICY_NAMES
from kvtier.replay import (
    DEFAULT_PAGE_BYTES,
    DEFAULT_PAGE_TOKENS,
    ReplayConfig,
    ReplayResult,
    count_distinct_pages,
    opt_hit_ratio,
    parse_capacity,
    read_trace,
)
from kvtier.replay import replay as run_replay
from kvtier.sizes import format_bytes, parse_bytes

PLOT_CAPACITIES = ("1%", "2%", "5%", "10%", "25%")
PLOT_POLICIES = ("lru", "arc", "s3fifo", "prefix")


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
    for name in (host_policy, disk_policy):
        if name not in POLICY_NAMES:
            raise click.BadParameter(f"unknown policy {name!r}; choose one of "
                                     f"{', '.join(POLICY_NAMES)}", param_hint="--policy")
    return host_policy, disk_policy


@click.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--policy", "policy_spec", default=None,
              help="Policies per tier: NAME (host), or host=NAME,disk=NAME. "
                   f"Known: {', '.join(POLICY_NAMES)}. "
                   f"Default: host {DEFAULT_HOST_POLICY}, disk lru.")
@click.option("--host-policy", default=None, help="Host tier policy (overrides --policy).")
@click.option("--disk-policy", default=None, help="Disk tier policy (overrides --policy).")
@click.option("--host-capacity", default="5%", show_default=True,
              help="Pages (9140), a share of the trace's distinct pages (5%), or bytes (64GiB, "
                   "divided by --page-bytes).")
@click.option("--disk-capacity", default="0", show_default=True,
              help="Same forms as --host-capacity; 0 replays without a disk tier.")
@click.option("--write-policy", type=click.Choice([p.value for p in WritePolicy]),
              default=WritePolicy.WRITE_BACK.value, show_default=True,
              help="When pages reach disk.")
@click.option("--page-tokens", default=DEFAULT_PAGE_TOKENS, show_default=True,
              type=click.IntRange(1), help="Tokens per page of the trace's hash_ids.")
@click.option("--page-bytes", default=str(DEFAULT_PAGE_BYTES), show_default=True,
              help="Bytes per page: converts byte capacities and reports traffic.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also draw host hit ratio against capacity "
                                 f"({', '.join(PLOT_CAPACITIES)}) for {', '.join(PLOT_POLICIES)}, "
                                 "the chosen policy and OPT into this PNG (needs matplotlib).")
def replay_command(trace: Path, policy_spec: str | None, host_policy: str | None,
                   disk_policy: str | None, host_capacity: str, disk_capacity: str,
                   write_policy: str, page_tokens: int, page_bytes: str, as_json: bool,
                   plot_path: Path | None) -> None:
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
    try:
        page_bytes_value = parse_bytes(page_bytes)
        requests = read_trace(trace)
        num_distinct = count_distinct_pages(requests)
        config = ReplayConfig(
            host_pages=parse_capacity(host_capacity, num_distinct, page_bytes_value),
            host_policy=host_policy,
            disk_pages=parse_capacity(disk_capacity, num_distinct, page_bytes_value),
            disk_policy=disk_policy, write_policy=WritePolicy(write_policy),
            page_tokens=page_tokens, page_bytes=page_bytes_value)
    except KvtierError as exc:
        raise click.ClickException(str(exc)) from exc
    console = Console(stderr=as_json)
    with Progress(console=console, transient=True, disable=as_json) as progress:
        task = progress.add_task(f"replaying {trace.name}", total=len(requests))
        result = run_replay(requests, config, on_request=lambda _: progress.advance(task))
    opt = opt_hit_ratio(requests, config.host_pages + config.disk_pages, page_tokens)
    if plot_path is not None:
        _plot(plot_path, requests, config, num_distinct, console, as_json)
    if as_json:
        click.echo(json.dumps(_to_json(result, config, num_distinct, opt)))
        return
    console.print(_result_table(result, config, opt))
    console.print(
        f"{result.num_requests} requests, {result.num_references} page references, "
        f"{num_distinct} distinct pages; disk written {format_bytes(result.bytes_written_disk)}, "
        f"promoted {format_bytes(result.bytes_promoted)} ({result.pages_promoted} pages), "
        f"demoted {result.pages_demoted} pages")


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


def _plot(path: Path, requests, config: ReplayConfig, num_distinct: int,  # noqa: ANN001
          console: Console, quiet: bool) -> None:
    try:
        import matplotlib
    except ImportError:
        raise click.ClickException(
            "--plot needs matplotlib: pip install 'kvtier[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys((*PLOT_POLICIES, config.host_policy)))
    pages = [parse_capacity(c, num_distinct, config.page_bytes) for c in PLOT_CAPACITIES]
    pages = [max(1, p) for p in pages]
    ratios: dict[str, list[float]] = {}
    with Progress(console=console, transient=True, disable=quiet) as progress:
        task = progress.add_task("plotting", total=len(policies) * len(pages))
        for name in policies:
            ratios[name] = []
            for capacity in pages:
                one = ReplayConfig(host_pages=capacity, host_policy=name,
                                   page_tokens=config.page_tokens, page_bytes=config.page_bytes)
                ratios[name].append(run_replay(requests, one).block_hit_ratio)
                progress.advance(task)
    ratios["Belady OPT"] = [opt_hit_ratio(requests, c, config.page_tokens) for c in pages]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    shares = [100 * p / max(1, num_distinct) for p in pages]
    for name, values in ratios.items():
        axes.plot(shares, [100 * v for v in values], marker="o", label=name,
                  linestyle="--" if name == "Belady OPT" else "-")
    axes.set_xscale("log")
    axes.set_xlabel("host capacity (% of distinct pages)")
    axes.set_ylabel("block hit ratio (%)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


replay = replay_command
