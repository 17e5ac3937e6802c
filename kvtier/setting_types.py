"""What a setting is: its declaration on a config field, and the kinds of value settings take.

A config dataclass declares each of its settings once, on the field the value lands in:

    capacity_bytes: int = field(default=..., metadata=setting("host.capacity", SIZE,
                                                              "host tier size", example="8GiB"))

From that one declaration `kvtier.daemon.settings` derives the TOML key (`capacity` in
`[host]`), the environment variable (`KVTIER_HOST_CAPACITY`), the `kvtier serve` flag
(`--host-capacity`) and how the config is built. A `Kind` turns text from any of those sources, or a
value already of its type, into the field's value, and raises `ConfigError` with a sentence saying
what is wrong.
Verbs: `setting` (the field metadata), `declared` (a field's declaration, if any).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sizes import parse_bytes

ENV_PREFIX = "KVTIER_"
# Sections whose flags go without the section's name: they are the daemon's and the store's own
# (`--copy-threads`, `--write-policy`), where a tier's flags say the tier (`--host-capacity`).
UNPREFIXED_FLAG_SECTIONS = ("daemon", "store")
_METADATA_KEY = "kvtier.setting"


def show_value(value: object) -> str:
    """A value as a user writes it: enums by value, booleans in lower case, floats short."""
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple | list):
        return ",".join(show_value(item) for item in value)
    return str(value)


def show_size(num_bytes: object) -> str:
    """A byte count in the largest binary unit that divides it: 268435456 -> "256MiB"."""
    if not isinstance(num_bytes, int) or isinstance(num_bytes, bool):
        return show_value(num_bytes)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


@dataclass(slots=True, frozen=True)
class Kind:
    """How a setting's value is written and read: `parse` accepts text (environment, flags),
    TOML values and values of the field's own type, and raises `ConfigError`."""

    parse: Callable[[object], Any]
    metavar: str
    choices: tuple[str, ...] = ()  # listed in --help, when the values are a closed set
    show: Callable[[object], str] = show_value  # how a default reads in --help


@dataclass(slots=True, frozen=True)
class Setting:
    """One setting, declared on the config field that holds it.

    `name` is dotted, `section.key`; `example` is a valid value other than the default (shown
    nowhere, used by the tests to prove each setting reaches its field from every source);
    `flag` is the flag's stem when the derived one would read badly; `default_text` says what
    a default computed at start is (a share of RAM, a directory under $XDG_CACHE_HOME).
    `path` is filled in by `kvtier.daemon.settings`: the attributes from `DaemonConfig` to the
    field.
    """

    name: str
    kind: Kind
    help: str
    example: str
    flag: str = ""
    default_text: str = ""
    path: tuple[str, ...] = ()

    @property
    def section(self) -> str:
        """The TOML table: `host` for `host.capacity`."""
        return self.name.partition(".")[0]

    @property
    def key(self) -> str:
        """The key within its TOML table: `capacity` for `host.capacity`."""
        return self.name.partition(".")[2]

    @property
    def env_name(self) -> str:
        """Its environment variable: `KVTIER_HOST_CAPACITY`."""
        return ENV_PREFIX + self.name.upper().replace(".", "_")

    @property
    def flag_stem(self) -> str:
        """Its flag without the dashes: `host-capacity`, `copy-threads` (section dropped for
        `UNPREFIXED_FLAG_SECTIONS`), or the declared `flag`."""
        if self.flag:
            return self.flag
        stem = self.key if self.section in UNPREFIXED_FLAG_SECTIONS else self.name
        return stem.replace(".", "-").replace("_", "-")

    def parse(self, raw: object) -> Any:
        """`raw` as the field's value.

        Raises:
            ConfigError: `raw` is not a valid value (the message does not name the setting).
        """
        return self.kind.parse(raw)


def setting(name: str, kind: Kind, help: str, example: str, flag: str = "",
            default_text: str = "") -> Mapping[str, Setting]:
    """The field metadata that declares a setting (see the module docstring)."""
    return {_METADATA_KEY: Setting(name, kind, help, example, flag, default_text)}


def declared(config_field: Field[Any]) -> Setting | None:
    """The setting declared on a dataclass field, or None for a field that is not one."""
    return config_field.metadata.get(_METADATA_KEY)


def parse_bool(text: object) -> bool:
    """true/false, yes/no, on/off, 1/0 (any case), or a bool."""
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"not a boolean: {text!r} (use true or false)")


def parse_int(text: object) -> int:
    """An integer, or its decimal text; never a bool or a float."""
    if isinstance(text, bool) or not isinstance(text, int | str | bytes):
        raise ConfigError(f"not an integer: {text!r}")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"not an integer: {text!r}") from None


def _parse_count(text: object) -> int:
    value = parse_int(text)
    if value < 1:
        raise ConfigError(f"must be at least 1, got {value}")
    return value


def _parse_non_negative_int(text: object) -> int:
    value = parse_int(text)
    if value < 0:
        raise ConfigError(f"must not be negative, got {value}")
    return value


def _parse_size(text: object) -> int:
    value = parse_bytes(text)
    if value < 1:
        raise ConfigError(f"must be a positive size, got {text!r}")
    return value


def _parse_size_or_zero(text: object) -> int:
    value = parse_bytes(text)
    if value < 0:
        raise ConfigError(f"must not be negative, got {text!r}")
    return value


def _parse_seconds(text: object) -> float:
    try:
        value = float(str(text).removesuffix("s").strip()) if not isinstance(text, bool) else -1
    except ValueError:
        raise ConfigError(f"not a number of seconds: {text!r}") from None
    if value <= 0:
        raise ConfigError(f"must be a positive number of seconds, got {text!r}")
    return value


def _parse_path(text: object) -> Path:
    return Path(str(text)).expanduser()


BOOL = Kind(parse_bool, "BOOL")
COUNT = Kind(_parse_count, "N")  # an integer, at least 1
NON_NEGATIVE_INT = Kind(_parse_non_negative_int, "N")
SIZE = Kind(_parse_size, "SIZE", show=show_size)  # a positive byte size: 4096, 512MiB, 64GiB
SIZE_OR_ZERO = Kind(_parse_size_or_zero, "SIZE", show=show_size)
SECONDS = Kind(_parse_seconds, "SECONDS")  # a positive number, an optional "s" after it
PATH = Kind(_parse_path, "PATH")  # ~ expanded
TEXT = Kind(str, "TEXT")


def choice_of(enum_type: type[Enum], what: str) -> Kind:
    """The kind of a setting whose values are the members of `enum_type` (by value)."""
    values = tuple(str(member.value) for member in enum_type)

    def parse(text: object) -> Enum:
        if isinstance(text, enum_type):
            return text
        try:
            return enum_type(str(text))
        except ValueError:
            raise ConfigError(f"unknown {what} {text!r}; choose one of {', '.join(values)}"
                              ) from None

    return Kind(parse, "|".join(values), values)
