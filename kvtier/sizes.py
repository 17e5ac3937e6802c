"""Human byte sizes: parse "64GiB" / "512MB" / "1048576", and format bytes for people."""

from __future__ import annotations

import re

from kvtier.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: object) -> int:
    """Parse a byte size such as "64GiB", "1.5 GB" or 4096 (any other type is refused).

    Raises:
        ConfigError: the text is not a size, or names an unknown unit.
    """
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ConfigError(f"not a byte size: {text!r} (try 4096, \"512MiB\" or \"64GiB\")")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ConfigError(f"not a byte size: {text!r} (try 4096, 512MiB or 64GiB)")
    number, unit = match.groups()
    try:
        scale = _UNITS[unit.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown size unit {unit!r} in {text!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
        ) from None
    return int(float(number) * scale)


def format_bytes(num_bytes: float) -> str:
    """Format a byte count with a binary unit, e.g. 1536 -> "1.5 KiB"."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
