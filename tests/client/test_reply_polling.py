"""`ReplyPoller`: a quick reply is read by polling, a poll that misses backs off (and the read
still gets its bytes or its timeout), a slow reply is never polled for, and `Client` polls for
its quick verbs only."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.client.polling import MAX_SKIPPED_READS, ReplyPoller
from kvtier.testing import daemon as harness


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # A read with nothing to read times out at once (as a client's SO_RCVTIMEO would, later).
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 1_000))
    yield ours, theirs
    ours.close()
    theirs.close()


def miss(poller: ReplyPoller) -> None:
    """A polled read with nothing coming: the poll misses, then the sleeping read times out."""
    with pytest.raises(BlockingIOError):
        poller.recv(64, poll=True)


def read_sent(poller: ReplyPoller, theirs: socket.socket, reply: bytes) -> None:
    """The peer sends `reply`; a read asking to poll returns it."""
    theirs.sendall(reply)
    assert poller.recv(64, poll=True) == reply


def test_a_reply_already_there_is_caught_by_the_poll(pair) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=50_000)
    read_sent(poller, theirs, b"reply")
    assert (poller.polls_caught, poller.polls_missed) == (1, 0)


def test_a_missed_poll_sleeps_on_the_read_and_polls_less_until_one_catches(pair) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=200)
    miss(poller)
    assert poller.polls_missed == 1
    read_sent(poller, theirs, b"a")  # the one read after a miss is not polled
    assert poller.polls_caught == 0
    miss(poller)  # the second miss in a row: the next two reads are not polled
    read_sent(poller, theirs, b"b")
    read_sent(poller, theirs, b"c")
    assert (poller.polls_caught, poller.polls_missed) == (0, 2)
    read_sent(poller, theirs, b"d")  # polled again, and caught: polling back on
    assert poller.polls_caught == 1
    miss(poller)  # a miss after a catch skips one read again, not four
    read_sent(poller, theirs, b"e")
    read_sent(poller, theirs, b"f")
    assert (poller.polls_caught, poller.polls_missed) == (2, 3)


def test_misses_in_a_row_skip_twice_as_many_reads_each_up_to_the_cap(pair) -> None:
    ours, _ = pair
    poller = ReplyPoller(ours, poll_us=50)
    skipped_runs = []
    for _ in range(9):
        miss(poller)
        skipped = 0
        missed = poller.polls_missed
        while poller._reads_to_skip:
            with pytest.raises(BlockingIOError):
                poller.recv(64, poll=True)  # not polled: no miss counted
            assert poller.polls_missed == missed
            skipped += 1
        skipped_runs.append(skipped)
    assert skipped_runs == [1, 2, 4, 8, 16, 32, MAX_SKIPPED_READS, MAX_SKIPPED_READS,
                            MAX_SKIPPED_READS]


@pytest.mark.parametrize("poll_us, poll", [(0, True), (50_000, False)])
def test_no_poll_when_off_or_not_asked(pair, poll_us: float, poll: bool) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=poll_us)
    theirs.sendall(b"reply")
    assert poller.recv(64, poll=poll) == b"reply"
    with pytest.raises(BlockingIOError):
        poller.recv(64, poll=poll)
    assert (poller.polls_caught, poller.polls_missed) == (0, 0)


def test_a_negative_poll_time_is_refused(pair) -> None:
    with pytest.raises(ValueError, match="poll_us"):
        ReplyPoller(pair[0], poll_us=-1)


def test_the_client_polls_for_lookups_and_pings_not_for_a_store(daemon, make_pool,
                                                               monkeypatch) -> None:
    layout = harness.make_layout("page-first", 4)
    namespace = harness.namespace_for(layout, "polling")
    keys = harness.random_keys(np.random.default_rng(5), 4)
    with daemon.client("polling") as client:
        pool = make_pool(layout)
        handle = pool.register(client, namespace)
        harness.fill_random(pool, np.random.default_rng(6), range(4))
        asked: list[bool] = []  # each read's `poll`
        read = client._poller.recv
        monkeypatch.setattr(client._poller, "recv",
                            lambda num_bytes, poll: asked.append(poll) or read(num_bytes, poll))
        job = client.store(handle, keys, list(range(4)))
        assert job.result().ok
        assert asked and not any(asked)  # the store's completion: not polled for
        asked.clear()
        client.ping()
        assert client.lookup(handle, keys).num_prefix == 4
        assert len(asked) >= 2 and all(asked)
        client.unregister_pool(handle)
