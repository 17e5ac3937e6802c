"""The daemon's log output: plain lines for people (the default), or one JSON object per line for
log shippers (journald, Fluent Bit, Vector, Loki's promtail), chosen by `daemon.log_format`.

A JSON line carries `ts` (UTC, RFC 3339 with microseconds), `level`, `logger`, `message`, `pid`,
and `exception` (the formatted traceback) when there is one; the message is formatted before it
is written, so a shipper needs no Python to read it. Verbs: `configure_logging`.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from enum import Enum
from typing import TextIO


class LogFormat(Enum):
    """How log records are written."""

    PLAIN = "plain"  # "2026-12-01 08:00:00,000 INFO kvtier.daemon.process: kvtier ready on ..."
    JSON = "json"  # one JSON object per line


PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """Formats each record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        # ensure_ascii: a line stays one line and plain ASCII whatever a client named itself.
        return json.dumps(entry, ensure_ascii=True)


def configure_logging(level: str, log_format: LogFormat, stream: TextIO = sys.stderr) -> None:
    """Send every log record at `level` and above to `stream` in `log_format`; replaces the root
    logger's handlers, so it may be called again."""
    handler = logging.StreamHandler(stream)
    if log_format is LogFormat.JSON:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
