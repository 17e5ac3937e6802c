"""The connector's own settings: `kv_connector_extra_config`, checked once at engine start.

Every key is optional. An unknown key or a value of the wrong type stops the engine with one
sentence naming the key, so a typo never silently turns kvtier off. Verbs: `ConnectorOptions.parse`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvtier.client.polling import DEFAULT_POLL_US, MAX_POLL_US
from kvtier.errors import ConfigError

_HELP = {
    "socket": "the daemon's socket path (default: where `kvtier serve` puts it)",
    "model_id": "the name pages are shared under (default: the model path and a hash of its "
                "config); engines serving the same weights under different paths set the same one",
    "load": "recall pages the daemon holds instead of computing them (default true)",
    "store": "store newly computed full pages (default true)",
    "load_async": "recall while other requests run, the request waiting for its pages (default "
                  "true; at an idle engine a recall runs before the forward either way: there "
                  "is nothing to overlap; see park); false: always recall before the step's "
                  "forward",
    "park": "with load_async, when a recall parks its request: 'while_others_run' (the "
            "default: whenever requests of earlier steps are running) or 'when_cheaper' (only "
            "when the running requests would wait longer for the copy than the request waits "
            "for a step, both measured)",
    "recall_gbps": "the recall bandwidth (GB/s) 'when_cheaper' assumes (default 0: measured "
                   "from the engine's own recalls)",
    "store_scope": "which full pages to store: 'all' (prompt and generated, the default) or "
                   "'prompt' (the prompt's only)",
    "store_min_tokens": "store nothing of a request whose prompt is shorter than this many "
                        "tokens (default 0: every request)",
    "skip_stored": "look the pages up before storing them and send only those the daemon does "
                   "not hold (default true)",
    "reconnect_s": "seconds between attempts to reach an absent daemon (default 5)",
    "timeout_s": "seconds one call to the daemon may take before it counts as gone (default 30)",
    "poll_us": "microseconds the read of a quick reply (a pin, a lookup the shared index cannot "
               "answer) polls the socket before sleeping on it (default 100; 0: never polls, "
               "for a node whose CPUs are all busy)",
}


class Park(enum.StrEnum):
    """When an asynchronous recall parks its request (`kvtier.integrations.vllm.parking`)."""

    WHILE_OTHERS_RUN = "while_others_run"
    WHEN_CHEAPER = "when_cheaper"


class StoreScope(enum.StrEnum):
    """Which of a request's full pages are stored."""

    ALL = "all"  # prompt and generated tokens
    PROMPT = "prompt"  # the prompt's pages only: a later turn resends the answer as its prompt


@dataclass(slots=True, frozen=True)
class ConnectorOptions:
    """What `kv_connector_extra_config` may say; see `_HELP` for each key."""

    socket: str = ""
    model_id: str = ""
    load: bool = True
    store: bool = True
    load_async: bool = True
    park: Park = Park.WHILE_OTHERS_RUN
    recall_gbps: float = 0.0
    store_scope: StoreScope = StoreScope.ALL
    store_min_tokens: int = 0
    skip_stored: bool = True
    reconnect_s: float = 5.0
    timeout_s: float = 30.0
    poll_us: float = DEFAULT_POLL_US

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
            elif isinstance(default, int):
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif isinstance(default, enum.StrEnum):
                choices = type(default)
                ok = value in {choice.value for choice in choices}
                if not ok:
                    raise ConfigError(f"kv_connector_extra_config: {name} must be one of "
                                      + ", ".join(repr(c.value) for c in choices)
                                      + f", got {value!r} ({_HELP[name]})")
                value = choices(str(value))
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
        if not 0 <= options.poll_us <= MAX_POLL_US:
            raise ConfigError(f"kv_connector_extra_config: poll_us must be between 0 (never "
                              f"polls) and {MAX_POLL_US:g} microseconds, got {options.poll_us}")
        if not 0 <= options.recall_gbps <= 1e6:
            raise ConfigError(f"kv_connector_extra_config: recall_gbps must be 0 (measured) or "
                              f"a bandwidth in GB/s, got {options.recall_gbps}")
        if options.store_min_tokens < 0:
            raise ConfigError(f"kv_connector_extra_config: store_min_tokens must be 0 or more, "
                              f"got {options.store_min_tokens}")
        return options
