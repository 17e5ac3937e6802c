"""The hot paths at a glance: each bench's ratio beside its target, pass or fail, with the load.

Run:

    python bench/perf_check.py [--repo DIR] [--baseline DIR] [--runs N] [--quick] [--json]

Runs, one after the other, each in its own process with `--repo`'s `kvtier` and `bench/` (default:
this checkout), the hot-path benches in short settings, a few minutes in all:

- `bench_tiers.py --quick`: host store / recall against `np.copyto` (target >= 0.85), disk store
  until durable and disk cold recall against raw fdatasync'd writes and O_DIRECT reads (>= 0.8).
- `bench_ipc.py --no-metrics --repeats 3 --lookups 2000`: store and recall of one 512 MiB request
  through the daemon against `np.copyto`, per pool layout (>= 0.9); one-key lookup round trip
  against a bare socket echo (<= 2.0), beside references with no target (on one CPU, a client
  that never polls for its reply, an echo whose reply is polled for, an event-loop echo, the
  lookup frame on a raw connection); from the shared-memory index, where
  the bench prints them: `local_lookup_us_p50`, a 256-key lookup (<= 20 us),
  `local_lookup_16_us_p50`, 16 keys (<= 5 us), the daemon's cost of publishing and
  unpublishing a page (<= 1 us each) and the index's bytes per page held (<= 32).
- `bench_pool_copy.py --pages 32 --repeats 5`: the lanes' copies of a client's sealed memfd pool
  against a mapped copy (>= 0.9); where the bench predates sealed pools, the named pool's
  descriptor copies (`ratio`) stand in.
- `bench_transfer.py --pages 32 --repeats 3`: each lane against one contiguous copy (>= 0.8);
  duplex against serial, for reference.

`--quick` passes `--quick` to bench_ipc too (a 64 MiB request: a smoke run, not a measurement).
Prints one line per figure: value, target, pass / FAIL; the load average (os.getloadavg) before
and after each bench and the CPUs this process may use. Timings on a shared machine are noisy:
this is a guard to read, not a CI test. Exits 0 whatever the verdicts (a failed bench exits 1).

On a machine whose figures move 0.1-0.3 run to run, one run says little:

- `--runs N` runs each bench N times; a figure is the median of its runs (the verdict is the
  median's), printed with the lowest and highest.
- `--baseline DIR` runs another checkout's benches in turn with `--repo`'s, bench by bench and
  run by run (which goes first alternates), so both meet the same moments of the machine: the
  baseline's median is printed beside, with `change`, the candidate's median over the
  baseline's, oriented so that above 1 is better (a cost's ratio inverted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


@dataclass(slots=True, frozen=True)
class Figure:
    """One checked figure: where it comes from in a bench's JSON, and its target."""

    name: str
    read: Callable[[object], float | None]
    target: float | None  # None: printed for reference
    at_most: bool = False  # the figure is a cost (<= target), not a ratio to reach (>=)


def key(name: str) -> Callable[[object], float | None]:
    """Top-level `name` of a JSON object, or None when absent."""
    return lambda out: out.get(name) if isinstance(out, dict) else None


def pool_copy(layout: str, lane: str) -> Callable[[object], float | None]:
    """The sealed pool's ratio of one layout and lane (the file ratio in older benches)."""
    def read(out: object) -> float | None:
        for row in out if isinstance(out, list) else []:
            if row.get("layout") == layout:
                return row.get(f"{lane}_sealed_ratio", row.get(f"{lane}_ratio"))
        return None
    return read


BENCHES: list[tuple[str, list[str], list[Figure]]] = [
    ("bench_tiers.py", ["--quick"], [
        Figure(f"{prefix}_ratio_{size}", key(f"{prefix}_ratio_{size}"), target)
        for prefix, target in (("host_store", 0.85), ("host_recall", 0.85),
                               ("disk_store", 0.8), ("disk_recall", 0.8))
        for size in ("64k", "2m")]),
    ("bench_ipc.py", ["--no-metrics", "--repeats", "3", "--lookups", "2000"], [
        *(Figure(f"{verb}_ratio_{layout}", key(f"{verb}_ratio_{layout}"), 0.9)
          for verb in ("store", "recall") for layout in ("page_first", "layer_first")),
        Figure("lookup_ratio", key("lookup_ratio"), 2.0, at_most=True),
        Figure("lookup_ratio_one_cpu", key("lookup_ratio_one_cpu"), None),
        Figure("lookup_blocking_ratio", key("lookup_blocking_ratio"), None),
        Figure("lookup_vs_poll_echo", key("lookup_vs_poll_echo"), None),
        Figure("threaded_lookups_ratio", key("threaded_lookups_ratio"), None),
        Figure("loop_echo_ratio", key("loop_echo_ratio"), None),
        Figure("raw_lookup_ratio", key("raw_lookup_ratio"), None),
        Figure("local_lookup_us_p50", key("local_lookup_us_p50"), 20.0, at_most=True),
        Figure("local_lookup_16_us_p50", key("local_lookup_16_us_p50"), 5.0, at_most=True),
        Figure("index_publish_us_per_page", key("index_publish_us_per_page"), 1.0,
               at_most=True),
        Figure("index_unpublish_us_per_page", key("index_unpublish_us_per_page"), 1.0,
               at_most=True),
        Figure("index_bytes_per_page", key("index_bytes_per_page"), 32.0, at_most=True),
    ]),
    ("bench_pool_copy.py", ["--pages", "32", "--repeats", "5"], [
        Figure(f"pool_copy_{lane}_{layout}", pool_copy(layout, lane), 0.9)
        for layout in ("page-first", "layer-first") for lane in ("store", "recall")]),
    ("bench_transfer.py", ["--pages", "32", "--repeats", "3"], [
        Figure("lane_ratio_d2h", key("lane_ratio_d2h"), 0.8),
        Figure("lane_ratio_h2d", key("lane_ratio_h2d"), 0.8),
        Figure("duplex_ratio", key("duplex_ratio"), None),
    ]),
]


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (1 min) {five:.2f} (5 min)"


def run_bench(repo: Path, script: str, args: list[str], timeout_s: float) -> tuple[object, str]:
    """The bench's JSON output (None when it failed) and a line saying how it ran."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(repo / "bench" / script), "--json", *args],
                              cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s"
    took = f"{time.monotonic() - started:.0f} s"
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        return None, f"exit {done.returncode} after {took}: {' | '.join(tail)}"
    try:
        return json.loads(done.stdout), took
    except json.JSONDecodeError as exc:
        return None, f"no JSON after {took}: {exc}"


def verdict(figure: Figure, value: float | None) -> str:
    if value is None:
        return "absent"
    if figure.target is None:
        return "ref"
    ok = value <= figure.target if figure.at_most else value >= figure.target
    return "pass" if ok else "FAIL"


def median(values: list[float | None]) -> float | None:
    """The median of the runs that gave the figure; None when none did."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def change(figure: Figure, value: float | None, baseline: float | None) -> float | None:
    """`value` over `baseline`, above 1 when `value` is better (a cost's ratio inverted)."""
    if not value or not baseline:  # absent, or zero
        return None
    return baseline / value if figure.at_most else value / baseline


def figure_row(script: str, figure: Figure, values: list[float | None],
               baseline_values: list[float | None] | None) -> dict[str, object]:
    """One figure's line: the candidate's median and runs, its verdict, the baseline's median."""
    value = median(values)
    row: dict[str, object] = {"bench": script, "figure": figure.name, "value": value,
                              "values": values, "target": figure.target,
                              "at_most": figure.at_most, "verdict": verdict(figure, value)}
    if baseline_values is not None:
        baseline = median(baseline_values)
        row.update(baseline_value=baseline, baseline_values=baseline_values,
                   change=change(figure, value, baseline))
    return row


def format_row(row: dict[str, object], runs: int) -> str:
    def shown(value: object) -> str:
        return "-" if value is None else f"{value:.3f}"

    target = row["target"]
    target_text = "-" if target is None else f"{'<=' if row['at_most'] else '>='} {target:g}"
    line = f"{row['bench']:<20} {row['figure']:<28} {shown(row['value']):>9}"
    if runs > 1:
        present = [v for v in row["values"] if v is not None]  # type: ignore[attr-defined]
        spread = f"[{min(present):.3f}-{max(present):.3f}]" if present else "-"
        line += f" {spread:>15}"
    line += f" {target_text:>8}  {row['verdict']:<6}"
    if "baseline_value" in row:
        line += f"  baseline {shown(row['baseline_value']):>9}  change {shown(row['change']):>6}"
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE,
                        help="the checkout whose kvtier and bench/ run (default: this one)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout run in turn with --repo's, bench by bench: its "
                             "medians beside, and the change (above 1: --repo's is better)")
    parser.add_argument("--runs", type=int, default=1,
                        help="runs of each bench; a figure is the median of its runs")
    parser.add_argument("--quick", action="store_true", help="bench_ipc on a 64 MiB request")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per bench")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    checkouts = {"repo": args.repo.resolve()}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    for label, checkout in checkouts.items():
        if not (checkout / "bench").is_dir() or not (checkout / "kvtier").is_dir():
            parser.error(f"--{label} {checkout}: not a kvtier checkout (no bench/ or kvtier/)")
    cpus = len(os.sched_getaffinity(0))
    rows: list[dict[str, object]] = []
    failed_benches = 0
    compared = f", baseline {checkouts['baseline']}" if "baseline" in checkouts else ""
    print(f"perf_check of {checkouts['repo']}{compared}, {args.runs} run(s) of each bench, on "
          f"{cpus} CPUs (nproc), {load()}", file=sys.stderr)
    labelled = len(checkouts) > 1 or args.runs > 1  # each bench line says whose run it was
    for script, bench_args, figures in BENCHES:
        if args.quick and script == "bench_ipc.py":
            bench_args = [*bench_args, "--quick"]
        values: dict[str, list[list[float | None]]] = {
            label: [[] for _ in figures] for label in checkouts}
        for run in range(args.runs):
            order = list(checkouts.items())
            if run % 2:
                order.reverse()  # neither checkout always runs right after the other
            for label, checkout in order:
                before = load()
                out, how = run_bench(checkout, script, bench_args, args.timeout)
                failed_benches += out is None
                which = f" [{label} {run + 1}/{args.runs}]" if labelled else ""
                print(f"{script} {' '.join(bench_args)}{which}: {how}; {before} before, "
                      f"{load()} after", file=sys.stderr)
                for figure, runs_of_figure in zip(figures, values[label]):
                    runs_of_figure.append(figure.read(out) if out is not None else None)
        for index, figure in enumerate(figures):
            baseline_values = values["baseline"][index] if "baseline" in values else None
            rows.append(figure_row(script, figure, values["repo"][index], baseline_values))
            if not args.json:
                print(format_row(rows[-1], args.runs))
    if args.json:
        print(json.dumps({"repo": str(checkouts["repo"]),
                          "baseline": str(checkouts["baseline"]) if compared else None,
                          "runs": args.runs, "cpus": cpus, "load_after": os.getloadavg(),
                          "figures": rows}))
    num_failed = sum(row["verdict"] == "FAIL" for row in rows)
    print(f"{num_failed} of {sum(row['verdict'] in ('pass', 'FAIL') for row in rows)} figures "
          f"below target; {load()}", file=sys.stderr)
    return 1 if failed_benches else 0


if __name__ == "__main__":
    sys.exit(main())
