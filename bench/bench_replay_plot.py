"""`kvtier replay --plot`: the plot's replays in a pool of processes against one after another.

Run:

    python bench/bench_replay_plot.py [TRACE] [--requests N] [--jobs N] [--json]

TRACE defaults to the Mooncake conversation trace shipped in traces/; `--requests` keeps its first
N requests (default: all). The work is what `kvtier replay TRACE --plot` does at its defaults
(host lru at 5%): the command's replay and OPT, then one replay per plotted policy and capacity
and OPT per capacity.

- `serial_s`: every job one after the other in this process, duplicates included (the command's
  own replay and OPT are also points of the curves): what `--plot` did before.
- `pooled_s`: `run_jobs` as `--plot` runs it now, each distinct job once, in `--jobs` processes
  (default: the CPUs this process may use; worker start-up included).
- `speedup`: serial_s / pooled_s; `cpus`: the CPUs this process may use, the bound on it (with
  the duplicates saved). One run each: a run takes minutes, and it is its own warm-up.
- `serial_cpu_s`, `pooled_cpu_s`: CPU seconds of each, and the 1-minute load average at the end:
  on a shared machine other load takes the cores the pool would use, and the wall times show it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

from kvtier.cli.replay_plot import OptJob, default_num_processes, plot_curves, run_jobs
from kvtier.replay.replayer import ReplayConfig, count_distinct_pages, parse_capacity, read_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_trace.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=default_num_processes())
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    requests = read_trace(args.trace)[:args.requests]
    num_distinct = count_distinct_pages(requests)
    config = ReplayConfig(host_pages=parse_capacity("5%", num_distinct, 1 << 20))
    _, curves = plot_curves(config, num_distinct)
    jobs = [config, OptJob(config.host_pages, config.page_tokens),
            *(job for points in curves.values() for job in points)]

    started, cpu_started = time.perf_counter(), time.process_time()
    serial = [run_jobs(requests, [job], num_processes=1)[job] for job in jobs]
    serial_s, serial_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    started = time.perf_counter()
    pooled = run_jobs(requests, jobs, num_processes=args.jobs)
    pooled_s = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    pooled_cpu_s = children.ru_utime + children.ru_stime
    assert serial == [pooled[job] for job in jobs], "the pool must compute what one process does"

    figures = {"requests": len(requests), "jobs": len(jobs), "distinct_jobs": len(pooled),
               "processes": args.jobs, "cpus": default_num_processes(),
               "serial_s": round(serial_s, 2), "pooled_s": round(pooled_s, 2),
               "speedup": round(serial_s / pooled_s, 2), "serial_cpu_s": round(serial_cpu_s, 1),
               "pooled_cpu_s": round(pooled_cpu_s, 1),
               "load_average_1m": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(figures))
        return
    print(f"{figures['requests']} requests; {figures['jobs']} jobs ({figures['distinct_jobs']} "
          f"distinct); {figures['processes']} processes on {figures['cpus']} CPUs")
    print(f"one after another: {serial_s:.1f} s ({serial_cpu_s:.1f} s CPU)   pooled: "
          f"{pooled_s:.1f} s ({pooled_cpu_s:.1f} s CPU in its workers)   "
          f"speedup {serial_s / pooled_s:.2f}x   load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
