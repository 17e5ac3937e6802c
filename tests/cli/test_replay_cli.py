"""`kvtier replay` as a user meets it: one clear line for a bad trace or value, the exit status
convention, and `--plot` (checked first, drawn in %, computed in a pool of processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli.main import main
from kvtier.cli.replay_plot import PLOT_CAPACITIES, hit_ratio_figure, plot_curves, run_jobs
from kvtier.errors import TraceError
from kvtier.replay.replayer import (
    ReplayConfig,
    count_distinct_pages,
    parse_capacity,
    read_trace,
    replay,
)

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"
GOOD_LINE = b'{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}'


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped trace's first 300 requests."""
    path = tmp_path_factory.mktemp("trace") / "small.jsonl"
    path.write_text("\n".join(TRACE.read_text().splitlines()[:300]) + "\n")
    return path


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


def test_a_non_utf8_byte_is_one_line_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    latin1 = b'{"input_length": 5, "note": "caf\xe9", "hash_ids": [1]}'
    path.write_bytes(GOOD_LINE + b"\n" + latin1 + b"\n")
    message = f"{path}:2: not UTF-8 text (byte 0xe9 at column {latin1.index(0xE9) + 1})"
    with pytest.raises(TraceError) as excinfo:
        read_trace(path)
    assert str(excinfo.value) == message
    result = CliRunner().invoke(main, ["replay", str(path)])
    assert result.exit_code == 1
    assert error_lines(result.output) == [f"Error: {message}"]


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"])
def test_an_empty_trace_says_so(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    result = CliRunner().invoke(main, ["replay", str(path)])
    assert result.exit_code == 1
    assert error_lines(result.output) == [
        f"Error: {path}: no requests in the trace (the file is empty or blank)"]


@pytest.mark.parametrize(("flags", "words"), [
    (["--host-capacity", "banana"], ["'banana'", "9140", "5%", "64GiB"]),
    (["--disk-capacity", "lots"], ["--disk-capacity", "9140", "5%", "64GiB"]),
    (["--host-capacity", "0.0001%"], ["--host-capacity", "needs at least one"]),
    (["--page-bytes", "huge"], ["--page-bytes", "not a byte size"]),
    (["--policy", "mru"], ["unknown policy 'mru'"]),
    (["--jobs", "0"], ["--jobs"]),
])
def test_usage_errors_exit_2_with_every_form_named(small_trace: Path, flags: list[str],
                                                   words: list[str]) -> None:
    result = CliRunner().invoke(main, ["replay", str(small_trace), *flags])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output


def test_a_bad_trace_exits_1_and_a_missing_one_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(GOOD_LINE + b"\noops\n")
    assert CliRunner().invoke(main, ["replay", str(bad)]).exit_code == 1
    assert CliRunner().invoke(main, ["replay", str(tmp_path / "absent.jsonl")]).exit_code == 2


def test_plot_without_matplotlib_fails_before_reading_the_trace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"oops\n")  # were the trace read first, this would be the error
    result = CliRunner().invoke(main, ["replay", str(bad), "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 1
    assert error_lines(result.output) == [
        "Error: --plot needs matplotlib: pip install 'kvtier[plot]'"]
    assert not (tmp_path / "p.png").exists()


def test_plot_says_where_it_went_and_keeps_the_replays_figures(small_trace: Path,
                                                               tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    args = ["replay", str(small_trace), "--host-policy", "prefix", "--host-capacity", "5%",
            "--json"]
    alone = json.loads(CliRunner().invoke(main, args).stdout)
    plot = tmp_path / "hits.png"
    result = CliRunner().invoke(main, [*args, "--plot", str(plot), "--jobs", "2"])
    assert result.exit_code == 0, result.output
    with_plot = json.loads(result.stdout)  # stdout stays one JSON object
    assert with_plot.pop("plot_path") == str(plot.resolve())
    assert with_plot == alone  # the shared work changes no figure
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = CliRunner().invoke(main, ["replay", str(small_trace), "--plot", str(plot),
                                      "--jobs", "1"])
    assert table.exit_code == 0, table.output
    assert table.output.rstrip().endswith(f"plot written to {plot.resolve()}")


def test_the_pool_computes_what_one_process_does(small_trace: Path) -> None:
    requests = read_trace(small_trace)
    num_distinct = count_distinct_pages(requests)
    config = ReplayConfig(host_pages=parse_capacity("5%", num_distinct, 1 << 20),
                          host_policy="arc")
    _, curves = plot_curves(config, num_distinct)
    jobs = [config, *(job for points in curves.values() for job in points)]
    calls: list[None] = []
    pooled = run_jobs(requests, jobs, num_processes=2, on_done=lambda: calls.append(None))
    assert pooled == run_jobs(requests, jobs, num_processes=1)
    assert pooled[config] == replay(requests, config)
    assert len(calls) == len(set(jobs)) == len(jobs) - 1  # the command's own job is a point


def test_plot_axes_read_in_percent() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capacities = [10, 20, 50, 100, 250]  # of 1000 distinct pages: 1% .. 25%
    figure = hit_ratio_figure(capacities, 1000, {"lru": [0.05, 0.1, 0.2, 0.28, 0.35],
                                                 "Belady OPT": [0.25, 0.3, 0.36, 0.36, 0.36]})
    figure.canvas.draw()
    (axes,) = figure.axes
    x_labels = [t.get_text() for t in axes.get_xticklabels() if t.get_text()]
    y_labels = [t.get_text() for t in axes.get_yticklabels() if t.get_text()]
    plt.close(figure)
    assert x_labels == list(PLOT_CAPACITIES)
    assert y_labels and all(label.endswith("%") for label in y_labels)
    assert not any("^" in label for label in x_labels + y_labels)  # no 10^0, 10^1


def test_replay_into_a_pipe_says_each_phase(small_trace: Path) -> None:
    """Replaying and OPT each say so as they go when the output is not a terminal."""
    result = CliRunner().invoke(main, ["replay", str(small_trace)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    phases = [f"replaying {small_trace.name}: ",
              "computing Belady's OPT ...", "computing Belady's OPT: done in "]
    found = [next(i for i, line in enumerate(lines) if line.startswith(p)) for p in phases]
    assert found == sorted(found), result.output
    assert found[-1] < next(i for i, line in enumerate(lines) if "Belady OPT" in line)
