"""What `kvtier`'s exit status means, one convention for every command.

0: done, nothing wrong. 1: the command ran and found or hit a problem (`kvtier check` found
integrity problems, a trace is bad, the daemon could not start with settings that are right: a
port taken, a disk directory in use). 2: a usage error: a bad flag, value or argument (click's
own convention, so `--help` mistakes read the same), and a bad setting wherever it was given:
flag, `KVTIER_*` environment variable or config file alike (`BadSettingError`).
3: no daemon answers on the socket (`kvtier stats`, `kvtier check`).
"""

from __future__ import annotations

from enum import IntEnum

import click


class ExitCode(IntEnum):
    """The exit statuses of `kvtier` commands."""

    OK = 0
    PROBLEMS = 1
    USAGE = 2
    NO_DAEMON = 3


class NoDaemonError(click.ClickException):
    """No daemon answers on the socket: exit status 3, so scripts can tell it from problems."""

    exit_code = ExitCode.NO_DAEMON


class BadSettingError(click.ClickException):
    """A setting's value, name or file is wrong, from any source: exit status 2, as the same bad
    value given as a flag gets from click, so one mistake reads the same wherever it was made."""

    exit_code = ExitCode.USAGE
