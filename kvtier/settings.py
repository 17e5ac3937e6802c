"""Daemon settings: defaults, then a TOML file, then `KVTIER_*` environment, then CLI flags.

Every setting has a dotted name (`host.capacity`) that is its TOML key (section `[host]`, key
`capacity`), its environment variable (`KVTIER_HOST_CAPACITY`) and its flag's target. With no
file and no environment the defaults work: socket under `$XDG_RUNTIME_DIR/kvtier/`, host tier a
modest share of RAM, disk tier a capped directory under the user's cache dir.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config import (DiskConfig, HbmConfig, HostConfig, RemoteConfig,
                           StoreConfig, WritePolicy)
from kvtier.errors import ConfigError
from kvtier.policies import POLICY_NAMES
from kvtier.ipc.frames import DEFAULT_MAX_FRAME_BYTES
from kvtier.daemon.logs import LogFormat
from kvtier.daemon.limits import Limits
from kvtier.sizes import parse_bytes

ENV_PREFIX = "KVTIER_"
log = logging.getLogger(__name__)


def default_socket_path() -> Path:
    """`$XDG_RUNTIME_DIR/kvtier/kvtier.sock`, else a per-user directory under the temp dir."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime_dir) if runtime_dir else Path(tempfile.gettempdir()) / f"kvtier-{os.getuid()}"
    return base / "kvtier" / "kvtier.sock" if runtime_dir else base / "kvtier.sock"


@dataclass(slots=True, frozen=True)
class DaemonConfig:
    """Everything `kvtier serve` needs."""

    store: StoreConfig = field(default_factory=StoreConfig)
    socket_path: Path = field(default_factory=default_socket_path)
    allowed_uids: tuple[int, ...] = ()  # other uids than the daemon's own that may connect
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    copy_threads: int = 4
    max_inflight_per_client: int = 32
    max_namespaces_per_client: int = 64
    log_level: str = "info"
    limits: Limits = field(default_factory=Limits)  # what clients may hold (kvtier.daemon.limits)
    socket_group: str = ""  # group given the socket (mode 0660), so allowed uids can reach it
    log_format: LogFormat = LogFormat.PLAIN
    metrics_port: int | None = None  # None: no Prometheus endpoint
    metrics_address: str = "127.0.0.1"  # loopback unless set on purpose


def _parse_bool(text: object) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"not a boolean: {text!r} (use true or false)")


def _parse_int(text: object) -> int:
    if isinstance(text, bool | float):
        raise ConfigError(f"not an integer: {text!r}")
    try:
        return int(text)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ConfigError(f"not an integer: {text!r}") from None


def _parse_count(text: object) -> int:
    value = _parse_int(text)
    if value < 1:
        raise ConfigError(f"must be at least 1, got {value}")
    return value


def _parse_capacity(text: object) -> int:
    value = parse_bytes(text)  # type: ignore[arg-type]
    if value < 1:
        raise ConfigError(f"must be a positive size, got {text!r}")
    return value


def _parse_policy(text: object) -> str:
    name = str(text)
    if name not in POLICY_NAMES:
        raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return name


def _parse_uids(text: object) -> tuple[int, ...]:
    items = text if isinstance(text, list) else [p for p in str(text).split(",") if p.strip()]
    return tuple(_parse_int(item) for item in items)


def _parse_write_policy(text: object) -> WritePolicy:
    try:
        return WritePolicy(str(text))
    except ValueError:
        choices = ", ".join(p.value for p in WritePolicy)
        raise ConfigError(f"unknown write policy {text!r}; choose one of {choices}") from None


def _parse_seconds(text: object) -> float:
    try:
        value = float(str(text).removesuffix("s").strip()) if not isinstance(text, bool) else -1
    except ValueError:
        raise ConfigError(f"not a number of seconds: {text!r}") from None
    if value <= 0:
        raise ConfigError(f"must be a positive number of seconds, got {text!r}")
    return value


def _parse_optional_size(text: object) -> int:
    value = parse_bytes(text)  # type: ignore[arg-type]
    if value < 0:
        raise ConfigError(f"must not be negative, got {text!r}")
    return value


def _parse_remote_url(text: object) -> str:
    url = str(text).strip()
    RemoteConfig(url=url)  # checks each URL's scheme
    return url


def _parse_non_negative_int(text: object) -> int:
    value = _parse_int(text)
    if value < 0:
        raise ConfigError(f"must not be negative, got {value}")
    return value


def _parse_remote_write(text: object) -> str:
    mode = str(text)
    RemoteConfig(write=mode)  # checks the mode
    return mode


def _parse_hbm_device(text: object) -> int | None:
    if str(text).strip().lower() in ("", "host", "none"):
        return None
    value = _parse_int(text)
    if value < 0:
        raise ConfigError(f"must be a GPU number or host, got {text!r}")
    return value


def _parse_path(text: object) -> Path:
    return Path(str(text)).expanduser()


def _parse_log_level(text: object) -> str:
    level = str(text).lower()
    if level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"unknown log level {text!r}; choose debug, info, warning or error")
    return level


def _parse_log_format(text: object) -> LogFormat:
    try:
        return LogFormat(str(text).lower())
    except ValueError:
        raise ConfigError(f"unknown log format {text!r}; choose plain or json") from None


def _parse_port(text: object) -> int:
    try:
        value = _parse_int(str(text).strip() if isinstance(text, str) else text)
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


# dotted name -> (parser, what it means); the single list `--help` and errors are built from.
SETTINGS: dict[str, tuple[Callable[[object], object], str]] = {
    "daemon.socket": (_parse_path, "control socket path"),
    "daemon.allowed_uids": (_parse_uids, "other uids allowed to connect (comma-separated)"),
    "daemon.max_frame_bytes": (_parse_capacity, "largest control frame accepted"),
    "daemon.copy_threads": (_parse_count, "threads that copy pages and do disk I/O"),
    "daemon.max_inflight_per_client": (_parse_count, "requests one client may have in flight"),
    "daemon.max_namespaces_per_client": (_parse_count, "distinct namespaces one connection may "
                                                       "register"),
    "daemon.log_level": (_parse_log_level, "debug, info, warning or error"),
    "daemon.socket_group": (str, "group given the socket and its directory (socket 0660), for "
                                 "allowed_uids in that group; empty: 0600, or 0666 with allowed_uids"),
    "daemon.max_clients": (_parse_count, "connections at once; beyond, a clear refusal"),
    "daemon.max_pools_per_client": (_parse_count, "pools one connection may register"),
    "daemon.max_leases_per_client": (_parse_count, "live leases one connection may hold"),
    "daemon.max_lease": (_parse_seconds, "longest lease ttl a client may ask, in seconds; longer "
                                         "is refused"),
    "daemon.max_buffered_bytes": (_parse_capacity, "half-received frame bytes, all clients "
                                                   "together; beyond, the sender is cut off"),
    "daemon.frame_timeout": (_parse_seconds, "seconds a frame may take from first to last byte"),
    "daemon.frames_per_turn": (_parse_count, "frames one client gets answered before others "
                                             "get a turn"),
    "daemon.log_format": (_parse_log_format, "plain (for people) or json (one object per line, "
                                             "for log shippers)"),
    "metrics.port": (_parse_port, "serve Prometheus metrics on this TCP port; unset: off"),
    "metrics.address": (_parse_address, "address the metrics port listens on [127.0.0.1]; "
                                        "0.0.0.0 or :: exposes it to the network"),
    "host.capacity": (_parse_capacity, "host tier size, e.g. 8GiB"),
    "host.chunk": (_parse_capacity, "host slot chunk (largest page size)"),
    "host.policy": (_parse_policy, "host eviction policy"),
    "host.prefault": (_parse_bool, "touch the arena at start"),
    "hbm.capacity": (_parse_optional_size, "hbm tier size (device page pool above host); 0: off"),
    "hbm.chunk": (_parse_capacity, "hbm slot chunk (largest page size)"),
    "hbm.policy": (_parse_policy, "hbm eviction policy"),
    "hbm.promote_hits": (_parse_count, "hits after which a host page is promoted to hbm"),
    "hbm.device": (_parse_hbm_device, "GPU holding the hbm tier, or host for a host-memory "
                                      "stand-in"),
    "disk.enabled": (_parse_bool, "use a disk tier"),
    "disk.path": (_parse_path, "disk tier directory"),
    "disk.capacity": (_parse_capacity, "disk tier cap, e.g. 64GiB"),
    "disk.chunk": (_parse_capacity, "disk slot file chunk"),
    "disk.policy": (_parse_policy, "disk eviction policy"),
    "remote.url": (_parse_remote_url, "Redis/Valkey URL (redis://host:6379/0, rediss://...); several "
                         "comma-separated for a cluster; empty: no remote tier"),
    "remote.cluster": (_parse_bool, "treat a single URL as a cluster seed"),
    "remote.write": (_parse_remote_write, "through (send every stored page) or evict (send a "
                                          "page when its last local copy is evicted)"),
    "remote.timeout": (_parse_seconds, "seconds a remote round trip may take before it counts "
                                       "as a miss and the tier goes offline"),
    "remote.ttl": (_parse_non_negative_int, "seconds remote pages live on the server; 0: no expiry"),
    "remote.budget": (_parse_optional_size, "bytes this node may have written to the remote at "
                                            "once (oldest deleted first); 0: no cap"),
    "remote.key_prefix": (str, "prefix of every remote key"),
    "store.write_policy": (_parse_write_policy, "write-through, write-back or selective"),
    "store.selective_min_hits": (_parse_count, "hits before a page is demoted under selective"),
    "store.max_namespaces": (_parse_count, "namespaces known at once; when full, those without "
                                           "pages are forgotten, then registrations refused"),
    "store.max_model_id_bytes": (_parse_count, "longest namespace model id (and layout name)"),
}


def _flatten_toml(document: Mapping[str, object], source: str) -> dict[str, object]:
    flat: dict[str, object] = {}
    for section, table in document.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: top-level key {section!r} must be a [section]")
        for key, value in table.items():
            flat[f"{section}.{key}"] = value
    return flat


# KVTIER_* variables that are not settings (the last three are the test suite's and benches':
# CI sets them, and a daemon started by a test must not warn about them).
_OTHER_ENV = {"KVTIER_CONFIG", "KVTIER_TUNED", "KVTIER_TRACES", "KVTIER_TRUSTED_SERVER_UIDS",
              "KVTIER_REQUIRE_REDIS", "KVTIER_REQUIRE_VLLM", "KVTIER_VLLM_PYTHON"}


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    by_env_name = {ENV_PREFIX + name.upper().replace(".", "_"): name for name in SETTINGS}
    unknown = sorted(var for var in env if var.startswith(ENV_PREFIX)
                     and var not in by_env_name and var not in _OTHER_ENV)
    if unknown:
        log.warning("ignoring unknown environment variables %s; known: %s", ", ".join(unknown),
                    ", ".join(sorted(by_env_name)))
    return {by_env_name[var]: value for var, value in env.items() if var in by_env_name}


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, object] | None = None) -> DaemonConfig:
    """Build the daemon's config from the defaults, `path`, `env` and `overrides`, in that order.

    `path` defaults to `$KVTIER_CONFIG` when set. `overrides` uses dotted names (CLI flags).

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
    values: dict[str, object] = {}
    for source, layer in layers:
        for name, raw in layer.items():
            if name not in SETTINGS:
                raise ConfigError(f"{source}: unknown setting {name!r}; known settings: "
                                  f"{', '.join(SETTINGS)}")
            try:
                values[name] = SETTINGS[name][0](raw)
            except ConfigError as exc:
                raise ConfigError(f"{source}: {name}: {exc}") from None
    return _build(values)


def _build(values: dict[str, object]) -> DaemonConfig:
    def pick(prefix: str, mapping: dict[str, str]) -> dict[str, object]:
        return {attr: values[f"{prefix}.{key}"] for key, attr in mapping.items()
                if f"{prefix}.{key}" in values}

    host = HostConfig(**pick("host", {"capacity": "capacity_bytes", "chunk": "chunk_bytes",
                                      "policy": "policy", "prefault": "prefault"}))
    disk = DiskConfig(**pick("disk", {"enabled": "enabled", "path": "path",
                                      "capacity": "capacity_bytes", "chunk": "chunk_bytes",
                                      "policy": "policy"}))
    remote = RemoteConfig(**pick("remote", {"url": "url", "cluster": "cluster", "write": "write",
                                            "timeout": "timeout_s", "ttl": "ttl_s",
                                            "budget": "budget_bytes",
                                            "key_prefix": "key_prefix"}))
    hbm = HbmConfig(**pick("hbm", {"capacity": "capacity_bytes", "chunk": "chunk_bytes",
                                   "policy": "policy", "promote_hits": "promote_hits",
                                   "device": "device"}))
    store = StoreConfig(host=host, disk=disk, remote=remote, hbm=hbm, **pick("store", {
        "write_policy": "write_policy", "selective_min_hits": "selective_min_hits",
        "max_namespaces": "max_namespaces", "max_model_id_bytes": "max_model_id_bytes"}))
    daemon = pick("daemon", {"socket": "socket_path", "allowed_uids": "allowed_uids",
                             "max_frame_bytes": "max_frame_bytes", "copy_threads": "copy_threads",
                             "max_inflight_per_client": "max_inflight_per_client",
                             "max_namespaces_per_client": "max_namespaces_per_client",
                             "log_level": "log_level", "log_format": "log_format",
                             "socket_group": "socket_group"})
    metrics = pick("metrics", {"port": "metrics_port", "address": "metrics_address"})
    limits = Limits(**pick("daemon", {
        "max_clients": "max_clients", "max_pools_per_client": "max_pools_per_client",
        "max_leases_per_client": "max_leases_per_client", "max_lease": "max_lease_s",
        "max_buffered_bytes": "max_buffered_bytes", "frame_timeout": "frame_timeout_s",
        "frames_per_turn": "frames_per_turn"}))
    config = DaemonConfig(store=store, limits=limits, **daemon, **metrics)
    if config.max_frame_bytes < 1024:
        raise ConfigError("daemon.max_frame_bytes must be at least 1KiB")
    return config
