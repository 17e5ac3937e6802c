"""`kvtier serve`: run the daemon in the foreground.

Its flags are not written here: there is one per setting, derived from the settings' declarations
(`kvtier.daemon.settings.SETTINGS`), and `--help` groups them by the TOML table they belong to.
"""

from __future__ import annotations

from pathlib import Path

import click

from kvtier.cli.exit_codes import BadSettingError
from kvtier.cli.params import SettingValue
from kvtier.daemon.settings import SECTIONS, SETTINGS, DaemonConfig, default_of
from kvtier.errors import ConfigError, KvtierError
from kvtier.setting_types import BOOL, Setting


class SettingOption(click.Option):
    """The flag of one setting: `--host-capacity SIZE`, or `--prefault/--no-prefault` for a
    boolean. Not given, its value is None, so the file and the environment stand."""

    def __init__(self, declaration: Setting) -> None:
        stem, kind = declaration.flag_stem, declaration.kind
        flags = f"--{stem}/--no-{stem}" if kind is BOOL else f"--{stem}"
        super().__init__([flags, stem.replace("-", "_")], default=None,
                         type=None if kind is BOOL else SettingValue(kind),
                         metavar=f"[{kind.metavar}]" if kind.choices else kind.metavar)
        self.declaration = declaration

    def describe(self, defaults: DaemonConfig) -> str:
        """Its help line: what the setting does and its default."""
        declaration = self.declaration
        default = default_of(declaration, defaults)
        if declaration.default_text:
            shown = declaration.default_text
        elif declaration.kind is BOOL:
            shown = f"--{'' if default else 'no-'}{declaration.flag_stem}"
        else:
            shown = declaration.kind.show(default)
        return f"{declaration.help[:1].upper()}{declaration.help[1:]} [default: {shown}]."


class SettingsCommand(click.Command):
    """A command whose `--help` lists its setting flags under their TOML table's heading."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        defaults = DaemonConfig()
        plain_rows: list[tuple[str, str]] = []
        rows_by_section: dict[str, list[tuple[str, str]]] = {section: [] for section in SECTIONS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if isinstance(param, SettingOption):
                rows_by_section[param.declaration.section].append(
                    (record[0], param.describe(defaults)))
            else:
                plain_rows.append(record)
        with formatter.section("Options"):
            formatter.write_dl(plain_rows)
        for section, rows in rows_by_section.items():
            prefix = f"KVTIER_{section.upper()}_*"
            with formatter.section(f"[{section}] {SECTIONS[section]} ({prefix})"):
                formatter.write_dl(rows)


def setting_flags(command: click.Command) -> click.Command:
    """Add one `SettingOption` per declared setting to `command`."""
    command.params.extend(SettingOption(declaration) for declaration in SETTINGS.values())
    return command


def overrides_from(ctx: click.Context) -> dict[str, object]:
    """The settings the flags given on the command line set, by dotted name (None: not given)."""
    return {param.declaration.name: ctx.params[param.name]
            for param in ctx.command.params
            if isinstance(param, SettingOption) and param.name is not None}


@setting_flags
@click.command(cls=SettingsCommand)
@click.option("--config", "config_path",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML config file (default: $KVTIER_CONFIG, else built-in defaults).")
@click.pass_context
def serve(ctx: click.Context, config_path: Path | None, **_flags: object) -> None:
    """Run the kvtier daemon until SIGTERM or Ctrl-C.

    Settings come from defaults, then --config (or $KVTIER_CONFIG), then KVTIER_* environment
    variables, then these flags. Every setting is all three: --host-capacity is `capacity` in
    the file's [host] table and KVTIER_HOST_CAPACITY in the environment (the daemon's and the
    store's own flags drop their table's name: --copy-threads is [daemon] copy_threads).
    Readiness: the log line "kvtier ready on <socket>", or `kvtier stats`.

    \b
    Example:
      kvtier serve --host-capacity 32GiB --disk-path /nvme/kvtier --disk-capacity 1TiB
      kvtier serve --remote-url redis://cache.internal:6379/0   # share pages between nodes
      kvtier serve --metrics-port 9464 --log-format json        # in production (docs/operations.md)
    """
    from kvtier.daemon.logs import configure_logging
    from kvtier.daemon.process import Daemon
    from kvtier.daemon.settings import load_config
    from kvtier.tuning import reexec_tuned

    reexec_tuned()
    try:
        config = load_config(config_path, overrides=overrides_from(ctx))
    except ConfigError as exc:
        raise BadSettingError(str(exc)) from exc
    try:
        configure_logging(config.log_level, config.log_format)
        Daemon(config).run()
    except KvtierError as exc:
        raise click.ClickException(str(exc)) from exc
