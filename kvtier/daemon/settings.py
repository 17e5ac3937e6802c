"""Daemon settings: defaults, then a TOML file, then `KVTIER_*` environment, then CLI flags.

Each setting is declared once, on the config field it sets (`DaemonConfig` here, `Limits`, and
the store's configs in `kvtier.config`; see `kvtier.setting_types`). Its dotted name
(`host.capacity`) gives its TOML key (section `[host]`, key `capacity`), its environment variable
(`KVTIER_HOST_CAPACITY`) and its `kvtier serve` flag (`--host-capacity`); `SETTINGS` lists them
all, and `load_config` builds the config from them. With no file and no environment the
defaults work: socket under `$XDG_RUNTIME_DIR/kvtier/`, host tier a modest share of RAM, disk
tier a capped directory under the user's cache dir. Verbs: `load_config`, `default_of`.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import logging
import os
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvtier.config import StoreConfig
from kvtier.daemon.limits import Limits
from kvtier.daemon.logs import LogFormat
from kvtier.errors import ConfigError
from kvtier.ipc.frames import DEFAULT_MAX_FRAME_BYTES
from kvtier.ipc.socket_path import default_socket_path
from kvtier.setting_types import (
    COUNT,
    ENV_PREFIX,
    PATH,
    SIZE,
    TEXT,
    Kind,
    Setting,
    declared,
    parse_int,
    setting,
)

log = logging.getLogger(__name__)
_Config = TypeVar("_Config")


def _parse_uids(text: object) -> tuple[int, ...]:
    items = (text if isinstance(text, list | tuple)
             else [p for p in str(text).split(",") if p.strip()])
    return tuple(parse_int(item) for item in items)


LOG_LEVELS = ("debug", "info", "warning", "error")


def _parse_log_level(text: object) -> str:
    level = str(text).lower()
    if level not in LOG_LEVELS:
        raise ConfigError(f"unknown log level {text!r}; choose debug, info, warning or error")
    return level


def _parse_log_format(text: object) -> LogFormat:
    if isinstance(text, LogFormat):
        return text
    try:
        return LogFormat(str(text).lower())
    except ValueError:
        raise ConfigError(f"unknown log format {text!r}; choose plain or json") from None


def _parse_port(text: object) -> int:
    try:
        value = parse_int(text.strip() if isinstance(text, str) else text)
    except ConfigError:
        raise ConfigError(f"not a port number: {text!r} (use 1-65535)") from None
    if not 1 <= value <= 65535:
        raise ConfigError(f"port {value} is out of range (use 1-65535)")
    return value


def _parse_address(text: object) -> str:
    address = str(text).strip().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        raise ConfigError(f"not an IP address: {text!r} (e.g. 127.0.0.1, 0.0.0.0 or ::)") from None


UIDS = Kind(_parse_uids, "UID,...")
LOG_LEVEL = Kind(_parse_log_level, "|".join(LOG_LEVELS), LOG_LEVELS)
LOG_FORMAT = Kind(_parse_log_format, "|".join(f.value for f in LogFormat),
                  tuple(f.value for f in LogFormat))
PORT = Kind(_parse_port, "PORT")
ADDRESS = Kind(_parse_address, "ADDRESS")
MIN_FRAME_BYTES = 1024


@dataclass(slots=True, frozen=True)
class DaemonConfig:
    """Everything `kvtier serve` needs."""

    store: StoreConfig = field(default_factory=StoreConfig)
    socket_path: Path = field(default_factory=default_socket_path, metadata=setting(
        "daemon.socket", PATH, "control socket path", "/tmp/kvtier-example/k.sock",
        default_text="$XDG_RUNTIME_DIR/kvtier/kvtier.sock"))
    allowed_uids: tuple[int, ...] = field(default=(), metadata=setting(
        "daemon.allowed_uids", UIDS, "other uids than the daemon's own that may connect "
        "(comma-separated)", "1000,1001", default_text="none"))
    max_frame_bytes: int = field(default=DEFAULT_MAX_FRAME_BYTES, metadata=setting(
        "daemon.max_frame_bytes", SIZE, "largest control frame accepted (at least 1KiB)",
        "1MiB"))
    copy_threads: int = field(default=4, metadata=setting(
        "daemon.copy_threads", COUNT, "threads that copy pages and do disk I/O; a large batch "
        "of pool pages is also copied by up to this many at once (at most the CPUs, 4)", "3"))
    max_inflight_per_client: int = field(default=32, metadata=setting(
        "daemon.max_inflight_per_client", COUNT, "requests one client may have in flight", "8"))
    max_namespaces_per_client: int = field(default=64, metadata=setting(
        "daemon.max_namespaces_per_client", COUNT, "distinct namespaces one connection may "
        "register", "16"))
    max_namespaces_per_peer: int = field(default=64, metadata=setting(
        "daemon.max_namespaces_per_peer", COUNT, "distinct namespaces the connections of one "
        "process (uid and pid) may register together, so that no process fills "
        "store.max_namespaces", "16"))
    log_level: str = field(default="info", metadata=setting(
        "daemon.log_level", LOG_LEVEL, "log verbosity on stderr", "debug"))
    limits: Limits = field(default_factory=Limits)  # what clients may hold (kvtier.daemon.limits)
    socket_group: str = field(default="", metadata=setting(
        "daemon.socket_group", TEXT, "group given the socket and its directory (socket 0660), "
        "for allowed_uids in that group; empty: 0600, or 0666 with allowed_uids", "kvtier",
        default_text="none"))
    log_format: LogFormat = field(default=LogFormat.PLAIN, metadata=setting(
        "daemon.log_format", LOG_FORMAT, "plain (for people) or json (one object per line, for "
        "log shippers)", "json"))
    metrics_port: int | None = field(default=None, metadata=setting(
        "metrics.port", PORT, "serve Prometheus metrics on this TCP port, at "
        "http://ADDRESS:PORT/metrics", "9464", default_text="off"))
    metrics_address: str = field(default="127.0.0.1", metadata=setting(
        "metrics.address", ADDRESS, "address the metrics port listens on; 0.0.0.0 or :: exposes "
        "it to the network", "0.0.0.0"))

    def __post_init__(self) -> None:
        if self.max_frame_bytes < MIN_FRAME_BYTES:
            raise ConfigError("daemon.max_frame_bytes must be at least 1KiB")


# The TOML tables, in the order `--help` and error messages list them, with what each holds.
SECTIONS: dict[str, str] = {
    "daemon": "the daemon: its socket, threads and logs, and what each client may hold",
    "metrics": "the Prometheus endpoint",
    "host": "the host tier: one shared-memory arena",
    "hbm": "the hbm tier: a daemon-owned device pool above host",
    "disk": "the disk tier: a slot file and an index in one directory",
    "remote": "the remote tier: Redis or Valkey, shared between nodes",
    "store": "the store: when pages reach disk, how many namespaces it knows",
}


def _nested_config(config_type: type, config_field: dataclasses.Field[Any]) -> type | None:
    """The config dataclass a field holds (`StoreConfig.host`: `HostConfig`), if it holds one."""
    if declared(config_field) is not None:
        return None
    field_type = typing.get_type_hints(config_type)[config_field.name]
    is_config = isinstance(field_type, type) and dataclasses.is_dataclass(field_type)
    return field_type if is_config else None


def _declared_settings(config_type: type, path: tuple[str, ...] = ()) -> Iterator[Setting]:
    """Every setting declared on `config_type`'s fields and its nested configs', each with its
    attribute path from the top."""
    for config_field in dataclasses.fields(config_type):
        field_path = (*path, config_field.name)
        declaration = declared(config_field)
        nested = _nested_config(config_type, config_field)
        if declaration is not None:
            yield dataclasses.replace(declaration, path=field_path)
        elif nested is not None:
            yield from _declared_settings(nested, field_path)


# dotted name -> declaration: the one list the loader, `kvtier serve`'s flags and errors use.
SETTINGS: dict[str, Setting] = {
    s.name: s for s in sorted(_declared_settings(DaemonConfig),
                              key=lambda s: list(SECTIONS).index(s.section))}


def default_of(declaration: Setting, defaults: DaemonConfig | None = None) -> object:
    """The value a setting has when nothing sets it: in `defaults`, else computed now (as a
    starting daemon would)."""
    value: object = DaemonConfig() if defaults is None else defaults
    for attribute in declaration.path:
        value = getattr(value, attribute)
    return value


def _flatten_toml(document: Mapping[str, object], source: str) -> dict[str, object]:
    flat: dict[str, object] = {}
    for section, table in document.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: top-level key {section!r} must be a [section]")
        for key, value in table.items():
            flat[f"{section}.{key}"] = value
    return flat


# KVTIER_* variables that are not settings (those after the first four are the test suite's and
# benches': CI sets them, and a daemon started by a test must not warn about them).
_OTHER_ENV = {"KVTIER_CONFIG", "KVTIER_TUNED", "KVTIER_TRACES", "KVTIER_TRUSTED_SERVER_UIDS",
              "KVTIER_REQUIRE_REDIS", "KVTIER_REQUIRE_VLLM", "KVTIER_VLLM_PYTHON",
              "KVTIER_REQUIRE_SGLANG", "KVTIER_SGLANG_PYTHON"}


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    by_env_name = {declaration.env_name: name for name, declaration in SETTINGS.items()}
    unknown = sorted(var for var in env if var.startswith(ENV_PREFIX)
                     and var not in by_env_name and var not in _OTHER_ENV)
    for var in unknown:
        close = difflib.get_close_matches(var, by_env_name, n=1, cutoff=0.6)
        log.warning("ignoring unknown environment variable %s; %s", var,
                    f"did you mean {close[0]}?" if close else "`kvtier serve --help` lists them")
    return {by_env_name[var]: value for var, value in env.items() if var in by_env_name}


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, object] | None = None) -> DaemonConfig:
    """Build the daemon's config from the defaults, `path`, `env` and `overrides`, in that order.

    `path` defaults to `$KVTIER_CONFIG` when set. `overrides` uses dotted names (CLI flags);
    a None value is a flag not given.

    Raises:
        ConfigError: an unreadable file, an unknown setting (the message lists the known ones),
            or a bad value (the message names the setting and where it came from).
    """
    env = os.environ if env is None else env
    path = path or (Path(env["KVTIER_CONFIG"]) if env.get("KVTIER_CONFIG") else None)
    layers: list[tuple[str, dict[str, object]]] = []
    if path is not None:
        try:
            document = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        layers.append((str(path), _flatten_toml(document, str(path))))
    layers.append(("environment", _from_env(env)))
    layers.append(("command line", {k: v for k, v in (overrides or {}).items() if v is not None}))
    values: dict[tuple[str, ...], object] = {}
    for source, layer in layers:
        for name, raw in layer.items():
            if name not in SETTINGS:
                raise ConfigError(f"{source}: {_unknown_setting(name)}")
            try:
                values[SETTINGS[name].path] = SETTINGS[name].parse(raw)
            except ConfigError as exc:
                raise ConfigError(f"{source}: {name}: {exc}") from None
    return _build(DaemonConfig, values)


def _unknown_setting(name: str) -> str:
    """What to say of an unknown dotted name: the closest setting of its table, and only that
    table's settings (all 43 in one line helped nobody find the typo)."""
    section, _, _ = name.partition(".")
    if section not in SECTIONS:
        return (f"unknown setting {name!r}: there is no [{section}] table; tables: "
                f"{', '.join(f'[{known}]' for known in SECTIONS)}")
    in_section = [known for known, declaration in SETTINGS.items()
                  if declaration.section == section]
    close = difflib.get_close_matches(name, in_section, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown setting {name!r}; {hint}[{section}] has: {', '.join(in_section)}"


def _build(config_type: type[_Config], values: Mapping[tuple[str, ...], object],
           path: tuple[str, ...] = ()) -> _Config:
    """`config_type` with `values` (by attribute path from the top) set, its nested configs
    built the same way, and every other field at its default."""
    kwargs: dict[str, object] = {}
    for config_field in dataclasses.fields(config_type):  # type: ignore[arg-type]
        field_path = (*path, config_field.name)
        nested = _nested_config(config_type, config_field)
        if field_path in values:
            kwargs[config_field.name] = values[field_path]
        elif nested is not None:
            kwargs[config_field.name] = _build(nested, values, field_path)
    return config_type(**kwargs)
