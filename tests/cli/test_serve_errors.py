"""`kvtier serve` with bad input: one line of error, and one exit status per kind of mistake.

A bad setting exits 2 wherever it was given (flag, KVTIER_* environment, config file), as click
does for a bad flag; settings that are right but cannot be served (a disk path that is a
file) exit 1. docs/operations.md states the rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    """`kvtier serve` with a private socket and disk directory, and `args` after them."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "serve", "--socket", str(tmp_path / "s.sock"),
         "--disk-path", str(tmp_path / "disk"), "--host-capacity", "16MiB", "--no-prefault",
         *args], capture_output=True, text=True, timeout=120,
        env={**clean, "PYTHONPATH": str(REPO), **(env or {})})


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line (click's usage lines above a flag's error aside), no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.mark.parametrize("source", ["flag", "environment", "file"])
@pytest.mark.parametrize("setting, flag, value", [
    ("host.capacity", "--host-capacity", "lots"),
    ("metrics.port", "--metrics-port", "99999"),
])
def test_a_bad_value_exits_2_from_every_source(tmp_path: Path, source: str, setting: str,
                                               flag: str, value: str) -> None:
    section, key = setting.split(".")
    if source == "flag":
        result = serve(tmp_path, flag, value)
    elif source == "environment":
        result = serve(tmp_path, env={f"KVTIER_{section.upper()}_{key.upper()}": value})
    else:
        config = tmp_path / "kvtier.toml"
        config.write_text(f'[{section}]\n{key} = "{value}"\n')
        result = serve(tmp_path, "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert value in error_line(result)


def test_a_config_typo_suggests_the_setting_and_lists_only_its_table(tmp_path: Path) -> None:
    config = tmp_path / "kvtier.toml"
    config.write_text('[host]\ncapacty = "1GiB"\n')
    result = serve(tmp_path, "--config", str(config))
    assert result.returncode == 2, result.stderr
    line = error_line(result)
    assert "did you mean 'host.capacity'?" in line
    assert "chunk" in line and "policy" in line  # the rest of [host]
    assert "remote" not in line and "copy_threads" not in line, line
    assert len(line) < 300, line


def test_a_disk_path_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    result = serve(tmp_path, "--disk-path", str(a_file))
    assert result.returncode == 1, result.stderr
    assert f"disk tier path {a_file} is a file, not a directory" in error_line(result)
