"""An engine process with no daemon says so once, in one plain line, however many links it has."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.client.polling import DEFAULT_POLL_US
from kvtier.integrations.vllm.link import DaemonLink


def test_no_daemon_is_one_line_not_nested_and_not_repeated(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    socket_path = str(tmp_path / "absent.sock")
    # vLLM's scheduler and its worker each hold a link, in one process
    links = [DaemonLink(socket_path, name, lambda client: None, reconnect_s=0.0, timeout_s=5.0)
             for name in ("scheduler", "worker")]
    with caplog.at_level(logging.INFO, logger="vllm.kvtier"):
        for _ in range(2):
            assert [link.client() for link in links] == [None, None]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"kvtier: no daemon at {socket_path} (No such file or directory); serving "
                        f"without kvtier, retrying every 0 s; start one with `kvtier serve`"]


@pytest.mark.parametrize("poll_us, polls", [(0.0, False), (DEFAULT_POLL_US, True)])
def test_a_link_reads_quick_replies_as_its_poll_us_says(daemon, poll_us: float,
                                                         polls: bool) -> None:
    link = DaemonLink(str(daemon.socket_path), "polling", lambda client: None, reconnect_s=0.0,
                      timeout_s=5.0, poll_us=poll_us)
    client = link.client()
    assert client is not None
    try:
        for _ in range(8):
            client.ping()
        poller = client._poller
        assert (poller.polls_caught + poller.polls_missed > 0) == polls
    finally:
        client.close()
