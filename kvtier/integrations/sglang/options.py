"""The kvtier SGLang backend's settings, read from SGLang's storage extra config.

    --hicache-storage-backend-extra-config '{"backend_name": "kvtier", "module_path":
        "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
        "socket": "/run/user/1000/kvtier.sock", "model_id": "llama-3-8b@rev2"}'

Keys: `socket` (the daemon's socket; kvtier's default when absent), `model_id` (names the
model's pages; SGLang's model name when absent), `reconnect_s` (least time between two attempts
to reach an absent daemon), `timeout_s` (how long one call may wait for the daemon), `poll_us`
(how long the read of a quick reply polls the socket before sleeping on it; 0 never polls, for a
node whose CPUs are all busy).
SGLang's own keys pass through untouched. Verbs: `BackendOptions.from_extra_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.client.polling import DEFAULT_POLL_US, MAX_POLL_US
from kvtier.errors import ConfigError


@dataclass(slots=True, frozen=True)
class BackendOptions:
    """How the backend reaches the daemon and names its pages."""

    socket: str = ""
    model_id: str = ""
    reconnect_s: float = 2.0
    timeout_s: float = 30.0
    poll_us: float = DEFAULT_POLL_US

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> BackendOptions:
        """The options in SGLang's extra config.

        Raises:
            ConfigError: a value of the wrong type or out of range, naming the key.
        """
        values: dict[str, Any] = {}
        for key in ("socket", "model_id"):
            if key in extra:
                if not isinstance(extra[key], str):
                    raise ConfigError(f"kvtier extra config {key!r} must be a string")
                values[key] = extra[key]
        for key in ("reconnect_s", "timeout_s"):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                    raise ConfigError(f"kvtier extra config {key!r} must be a positive number "
                                      f"of seconds, got {value!r}")
                values[key] = float(value)
        if "poll_us" in extra:
            value = extra["poll_us"]
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not 0 <= value <= MAX_POLL_US):
                raise ConfigError(f"kvtier extra config 'poll_us' must be between 0 (never "
                                  f"polls) and {MAX_POLL_US:g} microseconds, got {value!r}")
            values["poll_us"] = float(value)
        return cls(**values)
