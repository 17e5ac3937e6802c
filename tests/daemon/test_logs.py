"""Log output: plain lines by default, one JSON object per line with --log-format json (or the
setting), tracebacks included, from the formatter and from a real daemon."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from kvtier.daemon.logs import LogFormat, configure_logging
from kvtier.daemon.settings import load_config


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_json_lines_carry_the_formatted_message_and_the_traceback(restore_root_logger) -> None:
    stream = io.StringIO()
    configure_logging("info", LogFormat.JSON, stream)
    log = logging.getLogger("kvtier.test")

    log.debug("not shown")
    log.warning("pool %s of client %r", 3, "engine\n0")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("copy failed")

    lines = stream.getvalue().splitlines()
    assert len(lines) == 2  # the newline inside the message stays inside its line
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "pool 3 of client 'engine\\n0'"
    assert (first["level"], first["logger"]) == ("warning", "kvtier.test")
    assert first["ts"].endswith("+00:00") and isinstance(first["pid"], int)
    assert "exception" not in first
    assert second["message"] == "copy failed"
    assert "ValueError: boom" in second["exception"]


def test_plain_is_the_default(restore_root_logger) -> None:
    assert load_config(env={}).log_format is LogFormat.PLAIN
    assert load_config(env={"KVTIER_DAEMON_LOG_FORMAT": "json"}).log_format is LogFormat.JSON
    stream = io.StringIO()
    configure_logging("info", load_config(env={}).log_format, stream)
    logging.getLogger("kvtier.test").info("hello")
    assert stream.getvalue().rstrip().endswith("INFO kvtier.test: hello")


def test_a_daemon_with_json_logs_writes_only_json_lines(make_daemon, socket_dir: Path,
                                                        tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--log-format", "json")
    daemon.stop_and_check()

    entries = [json.loads(line) for line in daemon.log().splitlines()]
    messages = [entry["message"] for entry in entries]
    assert any(message.startswith("kvtier ready on") for message in messages)
    assert any(message.startswith("kvtier stopped") for message in messages)
    assert {entry["pid"] for entry in entries} == {daemon.pid}


def test_a_daemon_logs_plain_lines_by_default(make_daemon, socket_dir: Path,
                                              tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "k.sock", tmp_path / "disk")
    daemon.stop_and_check()

    ready = [line for line in daemon.log().splitlines() if "kvtier ready on" in line]
    assert len(ready) == 1 and " INFO kvtier.daemon.process: kvtier ready on " in ready[0]
