"""`kvtier replay --plot`: host hit ratio against capacity for several policies and OPT, as a PNG.

The replays behind the curves are independent (one per policy and capacity, and OPT once per
capacity), so they run in a pool of worker processes, one per CPU this process may use, longest
first. The command's own replay and its OPT join the same pool, and a job asked twice (the
command's configuration is often one point of a curve) runs once.

Verbs: `require_matplotlib`, `plot_curves`, `run_jobs`, `hit_ratio_figure`, `draw_plot`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import click

from kvtier.replay.replayer import (
    ReplayConfig,
    ReplayResult,
    TraceRequest,
    opt_hit_ratio,
    parse_capacity,
)
from kvtier.replay.replayer import replay as run_replay

PLOT_CAPACITIES = ("1%", "2%", "5%", "10%", "25%")
PLOT_POLICIES = ("lru", "arc", "s3fifo", "prefix")
OPT_LABEL = "Belady OPT"
# Relative cost of one replay by host policy (measured on the Mooncake trace at 5%): the pool
# starts the longest jobs first so that its workers finish together.
POLICY_COST = {"prefix": 4.0, "s3fifo": 2.0, "arc": 1.5, "lru": 1.0}


@dataclass(slots=True, frozen=True)
class OptJob:
    """Belady OPT's block hit ratio for one tier of `capacity_pages`."""

    capacity_pages: int
    page_tokens: int


Job = ReplayConfig | OptJob


def require_matplotlib() -> None:
    """Fail at once, before any replay, when matplotlib is missing.

    Raises:
        click.ClickException: matplotlib cannot be imported; the message says how to install it.
    """
    try:
        import matplotlib
    except ImportError:
        raise click.ClickException(
            "--plot needs matplotlib: pip install 'kvtier[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed


def plot_curves(config: ReplayConfig, num_distinct_pages: int) -> tuple[list[int],
                                                                         dict[str, list[Job]]]:
    """The plot's capacities in pages and, per curve (each plotted policy, the command's host
    policy, OPT), the job behind each point: host tier only, the command's page size."""
    capacities = [max(1, parse_capacity(c, num_distinct_pages, config.page_bytes))
                  for c in PLOT_CAPACITIES]
    curves: dict[str, list[Job]] = {
        name: [ReplayConfig(host_pages=pages, host_policy=name, page_tokens=config.page_tokens,
                            page_bytes=config.page_bytes) for pages in capacities]
        for name in dict.fromkeys((*PLOT_POLICIES, config.host_policy))}
    curves[OPT_LABEL] = [OptJob(pages, config.page_tokens) for pages in capacities]
    return capacities, curves


def _expected_cost(job: Job) -> float:
    if isinstance(job, OptJob):
        return 0.5
    # Smaller tiers evict more; a disk tier adds a second cascade.
    return POLICY_COST.get(job.host_policy, 2.0) * (2.0 if job.disk_pages else 1.0) * (
        1.0 + 1.0 / (1.0 + job.host_pages / 10_000))


def run_jobs(requests: Sequence[TraceRequest], jobs: Sequence[Job], num_processes: int,
             on_done: Callable[[], None] | None = None) -> dict[Job, ReplayResult | float]:
    """Run each distinct job once: a `ReplayConfig` gives its `ReplayResult`, an `OptJob` its
    hit ratio. `num_processes` > 1 runs them in that many worker processes; `on_done` is called
    after each job."""
    distinct = sorted(dict.fromkeys(jobs), key=_expected_cost, reverse=True)
    results: dict[Job, ReplayResult | float] = {}
    if num_processes <= 1 or len(distinct) <= 1:
        _start_worker(requests)
        for job in distinct:
            results[job] = _run_job(job)
            if on_done is not None:
                on_done()
        return results
    # spawn, not fork: the parent runs threads (the progress display), which fork would copy
    # in whatever state they are in.
    with ProcessPoolExecutor(max_workers=min(num_processes, len(distinct)),
                             mp_context=get_context("spawn"), initializer=_start_worker,
                             initargs=(requests,)) as pool:
        futures = {pool.submit(_run_job, job): job for job in distinct}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if on_done is not None:
                on_done()
    return results


def default_num_processes() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


_worker_requests: Sequence[TraceRequest] = ()


def _start_worker(requests: Sequence[TraceRequest]) -> None:
    # Once per worker: the trace travels to each process once, not once per job.
    global _worker_requests
    _worker_requests = requests


def _run_job(job: Job) -> ReplayResult | float:
    if isinstance(job, OptJob):
        return opt_hit_ratio(_worker_requests, job.capacity_pages, job.page_tokens)
    return run_replay(_worker_requests, job)


def hit_ratio_figure(capacities: Sequence[int], num_distinct_pages: int,
                     ratios: Mapping[str, Sequence[float]]) -> Any:  # a matplotlib Figure
    """Block hit ratio (%) against host capacity (% of the trace's distinct pages, log scale),
    one line per curve; the x ticks read as `PLOT_CAPACITIES`."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, NullLocator, PercentFormatter

    figure, axes = plt.subplots(figsize=(7, 4.5))
    shares = [100 * pages / max(1, num_distinct_pages) for pages in capacities]
    for name, values in ratios.items():
        axes.plot(shares, [100 * v for v in values], marker="o", label=name,
                  linestyle="--" if name == OPT_LABEL else "-")
    axes.set_xscale("log")
    # Ticks at the plotted capacities, labelled as asked ("5%"), not as powers of ten.
    axes.set_xticks(shares, labels=list(PLOT_CAPACITIES[:len(shares)]))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.yaxis.set_major_formatter(PercentFormatter(xmax=100, decimals=0))
    axes.set_xlabel("host capacity (share of the trace's distinct pages)")
    axes.set_ylabel("block hit ratio")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return figure


def draw_plot(path: Path, capacities: Sequence[int], num_distinct_pages: int,
              ratios: Mapping[str, Sequence[float]]) -> None:
    """Write `hit_ratio_figure` to the PNG `path`."""
    import matplotlib.pyplot as plt

    figure = hit_ratio_figure(capacities, num_distinct_pages, ratios)
    figure.savefig(path, dpi=120)
    plt.close(figure)
