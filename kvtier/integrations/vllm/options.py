"""The connector's own settings: `kv_connector_extra_config`, checked once at engine start.

Every key is optional. An unknown key or a value of the wrong type stops the engine with one
sentence naming the key, so a typo never silently turns kvtier off. Verbs: `ConnectorOptions.parse`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvtier.errors import ConfigError

_HELP = {
    "socket": "the daemon's socket path (default: where `kvtier serve` puts it)",
    "model_id": "the name pages are shared under (default: the model path and a hash of its "
                "config); engines serving the same weights under different paths set the same one",
    "load": "recall pages the daemon holds instead of computing them (default true)",
    "store": "store newly computed full pages (default true)",
    "reconnect_s": "seconds between attempts to reach an absent daemon (default 5)",
    "timeout_s": "seconds one call to the daemon may take before it counts as gone (default 30)",
}


@dataclass(slots=True, frozen=True)
class ConnectorOptions:
    """What `kv_connector_extra_config` may say; see `_HELP` for each key."""

    socket: str = ""
    model_id: str = ""
    load: bool = True
    store: bool = True
    reconnect_s: float = 5.0
    timeout_s: float = 30.0

    @classmethod
    def parse(cls, extra: Mapping[str, object] | None) -> ConnectorOptions:
        """The options in `extra`, defaults for the keys it leaves out.

        Raises:
            ConfigError: an unknown key, a value of the wrong type, or a number out of range.
        """
        extra = dict(extra or {})
        defaults = {f.name: f.default for f in fields(cls)}
        unknown = sorted(set(extra) - set(defaults))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key {unknown[0]!r} for the kvtier "
                f"connector; known keys: " + "; ".join(f"{k}: {v}" for k, v in _HELP.items()))
        values: dict[str, object] = {}
        for name, value in extra.items():
            default = defaults[name]
            if isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                value = float(value) if ok else value  # type: ignore[arg-type]
            else:
                ok = isinstance(value, str)
            if not ok:
                raise ConfigError(f"kv_connector_extra_config: {name} must be "
                                  f"{type(default).__name__}, got {type(value).__name__} "
                                  f"{value!r} ({_HELP[name]})")
            values[name] = value
        options = cls(**values)  # type: ignore[arg-type]
        for name in ("reconnect_s", "timeout_s"):
            if not 0 < getattr(options, name) <= 3600:
                raise ConfigError(f"kv_connector_extra_config: {name} must be between 0 and "
                                  f"3600 seconds, got {getattr(options, name)}")
        return options
