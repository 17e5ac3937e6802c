"""Each setting is declared once; its TOML key, environment variable and `kvtier serve` flag are
derived from that declaration, and a value given through any of them lands in its config field.

`env` is always passed explicitly, so the tests never see this machine's environment.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli.main import main
from kvtier.cli.serve import SettingOption, overrides_from, serve
from kvtier.config import DiskConfig, HbmConfig, HostConfig, RemoteConfig, StoreConfig
from kvtier.daemon.limits import Limits
from kvtier.daemon.settings import SECTIONS, SETTINGS, DaemonConfig, default_of, load_config
from kvtier.setting_types import BOOL, Setting, declared

DECLARATIONS = list(SETTINGS.values())
CONFIG_TYPES = (DaemonConfig, Limits, StoreConfig, HostConfig, HbmConfig, DiskConfig, RemoteConfig)


def field_value(config: DaemonConfig, declaration: Setting) -> object:
    value: object = config
    for attribute in declaration.path:
        value = getattr(value, attribute)
    return value


def flag_args(declaration: Setting) -> list[str]:
    """The command line that sets `declaration` to its example."""
    if declaration.kind is BOOL:
        on = declaration.parse(declaration.example)
        return [f"--{'' if on else 'no-'}{declaration.flag_stem}"]
    return [f"--{declaration.flag_stem}", declaration.example]


def test_every_declared_field_is_a_setting_and_every_setting_a_declared_field() -> None:
    declared_names = {declared(f).name for config_type in CONFIG_TYPES
                      for f in dataclasses.fields(config_type) if declared(f) is not None}

    assert declared_names == set(SETTINGS)
    assert {d.section for d in DECLARATIONS} == set(SECTIONS)


def test_names_flags_and_environment_variables_are_distinct() -> None:
    assert len({d.env_name for d in DECLARATIONS}) == len(DECLARATIONS)
    assert len({d.flag_stem for d in DECLARATIONS}) == len(DECLARATIONS)
    assert len({d.path for d in DECLARATIONS}) == len(DECLARATIONS)


def test_every_setting_has_a_flag() -> None:
    flags = {param.declaration.name: param.opts for param in serve.params
             if isinstance(param, SettingOption)}

    assert set(flags) == set(SETTINGS)
    assert flags["host.capacity"] == ["--host-capacity"]
    assert flags["daemon.socket"] == ["--socket"]
    assert flags["store.write_policy"] == ["--write-policy"]
    assert flags["disk.enabled"] == ["--disk"] and flags["host.prefault"] == ["--prefault"]


@pytest.mark.parametrize("declaration", DECLARATIONS, ids=lambda d: d.name)
def test_each_setting_reaches_its_field_from_the_file_the_environment_and_the_flag(
        declaration: Setting, tmp_path: Path) -> None:
    expected = declaration.parse(declaration.example)
    assert expected != default_of(declaration), "the example must differ from the default"
    config_file = tmp_path / "kvtier.toml"
    config_file.write_text(f"[{declaration.section}]\n{declaration.key} = "
                           f"{declaration.example!r}\n")
    ctx = serve.make_context("serve", flag_args(declaration))

    from_file = load_config(config_file, env={})
    from_env = load_config(env={declaration.env_name: declaration.example})
    from_flag = load_config(env={}, overrides=overrides_from(ctx))

    assert field_value(from_file, declaration) == expected
    assert field_value(from_env, declaration) == expected
    assert field_value(from_flag, declaration) == expected
    assert declaration.parse(expected) == expected  # a parsed value parses to itself


def test_flags_not_given_leave_the_file_and_the_environment_alone() -> None:
    ctx = serve.make_context("serve", ["--host-capacity", "2GiB"])

    overrides = overrides_from(ctx)
    config = load_config(env={"KVTIER_DISK_CAPACITY": "3GiB"}, overrides=overrides)

    assert {name for name, value in overrides.items() if value is not None} == {"host.capacity"}
    assert config.store.host.capacity_bytes == 2 << 30
    assert config.store.disk.capacity_bytes == 3 << 30


@pytest.mark.parametrize(("args", "problem"), [
    (["--host-capacity", "lots"], "not a byte size"),
    (["--host-policy", "mru"], "unknown policy 'mru'"),
    (["--write-policy", "sometimes"], "unknown write policy 'sometimes'"),
    (["--metrics-port", "70000"], "port 70000 is out of range"),
])
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(args: list[str], problem: str) -> None:
    result = CliRunner().invoke(main, ["serve", *args])

    assert result.exit_code == 2
    assert args[0] in result.output and problem in result.output


def test_serve_help_groups_the_flags_by_table_with_their_defaults() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])

    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for section in SECTIONS:
        assert f"[{section}] {SECTIONS[section]} (KVTIER_{section.upper()}_*)" in text
    assert "--host-policy [adaptive|arc|leader|lru|prefix|s3fifo]" in text
    assert "[default: prefix]" in text and "--prefault / --no-prefault" in text
