"""perf_check's verdicts over several runs and its comparison with a baseline checkout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "perf_check.py"
_SPEC = importlib.util.spec_from_file_location("perf_check", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
perf_check = importlib.util.module_from_spec(_SPEC)
sys.modules["perf_check"] = perf_check  # dataclasses look their module up while building
_SPEC.loader.exec_module(perf_check)

RATIO = perf_check.Figure("host_store_ratio_64k", perf_check.key("x"), 0.85)
COST = perf_check.Figure("lookup_ratio", perf_check.key("x"), 2.0, at_most=True)


def test_a_figure_is_judged_by_the_median_of_the_runs_that_gave_it() -> None:
    row = perf_check.figure_row("bench_tiers.py", RATIO, [0.70, None, 0.90, 0.88], None)
    assert row["value"] == 0.88
    assert row["verdict"] == "pass"
    row = perf_check.figure_row("bench_tiers.py", RATIO, [0.70, 0.95, 0.80], None)
    assert (row["value"], row["verdict"]) == (0.80, "FAIL")
    row = perf_check.figure_row("bench_ipc.py", COST, [2.4, 1.9, 2.1], None)
    assert (row["value"], row["verdict"]) == (2.1, "FAIL")
    assert perf_check.figure_row("bench_ipc.py", COST, [None, None], None)["verdict"] == "absent"


def test_the_change_against_the_baseline_is_above_one_when_the_candidate_is_better() -> None:
    faster = perf_check.figure_row("bench_tiers.py", RATIO, [0.9, 1.0, 1.1], [0.4, 0.5, 0.6])
    assert faster["baseline_value"] == 0.5
    assert faster["change"] == pytest.approx(2.0)
    cheaper = perf_check.figure_row("bench_ipc.py", COST, [1.0, 1.1, 0.9], [2.0, 2.2, 1.8])
    assert cheaper["change"] == pytest.approx(2.0)  # a cost halved is better, as a ratio doubled
    costlier = perf_check.figure_row("bench_ipc.py", COST, [4.0], [2.0])
    assert costlier["change"] == pytest.approx(0.5)
    assert perf_check.figure_row("bench_ipc.py", COST, [4.0], [None])["change"] is None


def test_a_line_shows_the_spread_of_the_runs_and_the_baseline_beside() -> None:
    row = perf_check.figure_row("bench_tiers.py", RATIO, [0.7, 0.9, 0.8], [0.4, 0.5, 0.6])
    line = perf_check.format_row(row, runs=3)
    assert "0.800" in line and "[0.700-0.900]" in line and "FAIL" in line
    assert "baseline     0.500" in line and "change  1.600" in line
