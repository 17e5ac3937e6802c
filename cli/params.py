"""Click parameter types shared by the commands."""

from __future__ import annotations

import click

from kvtier.errors import KvtierError
from kvtier.sizes import parse_bytes


class ByteSize(click.ParamType):
    """A size like 256MiB, 64GiB or 4096."""

    name = "size"

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value)
        except KvtierError as exc:
            self.fail(str(exc), param, ctx)


BYTES = ByteSize()
