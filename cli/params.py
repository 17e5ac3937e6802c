"""Click parameter types shared by the commands."""

from __future__ import annotations

from typing import Any

import click

from kvtier.errors import KvtierError
from kvtier.setting_types import Kind
from kvtier.sizes import parse_bytes


class ByteSize(click.ParamType):
    """A size like 256MiB, 64GiB or 4096."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value)
        except KvtierError as exc:
            self.fail(str(exc), param, ctx)


BYTES = ByteSize()


class SettingValue(click.ParamType):
    """The value of one daemon setting, checked by the setting's own kind (what the TOML file and
    the environment go through too), so a bad flag is a usage error naming the flag."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.name = kind.metavar.lower()

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        try:
            return self.kind.parse(value)
        except KvtierError as exc:
            self.fail(str(exc), param, ctx)
