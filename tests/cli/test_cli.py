"""The `kvtier` command line as a user meets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier import __version__
from kvtier.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_help_lists_the_commands() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "version" in result.output


def test_version_prints_the_package_version() -> None:
    result = CliRunner().invoke(main, ["version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kvtier {__version__}"


def test_console_script_runs() -> None:
    script = Path(sys.executable).with_name("kvtier")
    done = subprocess.run([str(script), "version"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"kvtier {__version__}"


def test_demo_pages_json_reuses_and_verifies_pages(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, [
        "demo", "--workload", "pages", "--requests", "12", "--host-capacity", "16MiB",
        "--disk-capacity", "256MiB", "--disk-path", str(tmp_path / "disk"), "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    demo = report["demo"]
    assert report["workload"] == "pages" and report["daemon_exit_code"] == 0
    assert demo["wrong_pages"] == 0 and report["check_problems"] == []
    assert demo["pages_reused"] > 0
    assert demo["pages_verified"] == demo["pages_reused"]
    tiers = {t["tier"]: t for t in report["stats"]["tiers"]}
    assert tiers["host"]["used_bytes"] <= tiers["host"]["capacity_bytes"]
    assert tiers["disk"]["num_pages"] > 0  # a 16 MiB host tier overflowed to disk


def test_demo_model_json_reuses_the_system_prompt(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    result = CliRunner().invoke(main, ["demo", "--workload", "model", "--requests", "2",
                                       "--host-capacity", "256MiB", "--json"])
    assert result.exit_code == 0, result.output
    prompts = json.loads(result.stdout)["demo"]["prompts"]
    assert prompts[0]["reused_tokens"] == 0
    assert prompts[1]["reused_tokens"] == 1024  # the shared system prompt's 64 pages
    assert all(p["same_tokens"] for p in prompts)


def test_demo_rejects_a_bad_size() -> None:
    result = CliRunner().invoke(main, ["demo", "--host-capacity", "lots"])
    assert result.exit_code == 2
    assert "not a byte size" in result.output


def test_demo_reports_a_disk_in_use(tmp_path: Path) -> None:
    from kvtier.config import DiskConfig, HostConfig, StoreConfig
    from kvtier.store.page_store import PageStore

    disk = tmp_path / "disk"
    config = StoreConfig(HostConfig(capacity_bytes=1 << 20),
                         DiskConfig(path=disk, capacity_bytes=1 << 24))
    with PageStore(config):
        result = CliRunner().invoke(main, ["demo", "--workload", "pages", "--requests", "1",
                                           "--disk-path", str(disk), "--host-capacity", "8MiB"])
    assert result.exit_code == 1
    assert "in use" in result.output


def test_help_imports_no_command_module() -> None:
    """`kvtier --help` cost 0.4 s of CPU importing every command's module (numpy, the store,
    the replayer) for one-line helps; the commands now load when they run."""
    probe = ("import sys\nfrom kvtier.cli.main import main\ntry:\n    main(['--help'])\n"
             "except SystemExit:\n    pass\n"
             "print(sorted(m for m in ('numpy', 'kvtier.cli.serve', 'kvtier.cli.replay') "
             "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert "kvtier serve" in result.stdout  # the help itself
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_every_command_still_runs_by_name() -> None:
    for name in ("serve", "stats", "check", "demo", "replay", "replay-family", "version"):
        result = CliRunner().invoke(main, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)


def test_demo_into_a_pipe_shows_each_phase_and_steps_before_the_result(tmp_path: Path) -> None:
    """Output that is not a terminal (CliRunner's, a CI log) got nothing until the end."""
    result = CliRunner().invoke(main, [
        "demo", "--workload", "pages", "--requests", "12", "--host-capacity", "16MiB",
        "--disk-capacity", "256MiB", "--disk-path", str(tmp_path / "disk")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    started = lines.index("starting kvtier serve (default configuration) ...")
    last_step = next(i for i, line in enumerate(lines) if line.startswith("requests: 12/12 ("))
    summary = next(i for i, line in enumerate(lines) if line.startswith("12 requests, "))
    assert started < last_step < summary
    assert sum(line.startswith("requests: ") for line in lines) == 10  # one a tenth


def test_demo_model_rows_appear_as_each_prompt_is_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo printed nothing for minutes, then its whole table: each prompt's row now shows
    as soon as it is measured. The model run is replaced by one that hands over two prompts'
    figures and looks at what was printed in between (the real run takes minutes here)."""
    import io

    from rich.console import Console

    from kvtier.cli import demo as demo_command
    from kvtier.integrations import model_demo

    output = io.StringIO()
    printed_between: list[str] = []
    figures = [model_demo.PromptFigures(1072, 0, 414.0, 433.0, True),
               model_demo.PromptFigures(1088, 1024, 426.0, 61.0, True)]

    def two_prompts(client: object, num_prompts: int, on_prompt) -> list:  # noqa: ANN001
        on_prompt(figures[0])
        printed_between.append(output.getvalue())
        on_prompt(figures[1])
        return figures

    monkeypatch.setattr(model_demo, "run_model_demo", two_prompts)
    assert demo_command._run_model(None, 2, Console(file=output, width=120), False) == figures
    assert "prompt 1/2: tokens 1072, reused 0, plain ms 414, kvtier ms 433" in printed_between[0]
    assert "prompt 2/2" not in printed_between[0]
    assert "prompt 2/2: tokens 1088, reused 1024" in output.getvalue()
    assert "time to first token" in output.getvalue()  # the whole table at the end
