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
    config = StoreConfig(HostConfig(capacity_bytes=1 << 20), DiskConfig(path=disk, capacity_bytes=1 << 24))
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
