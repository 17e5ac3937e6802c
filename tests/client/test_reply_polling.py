"""`ReplyPoller`: a quick reply is read by polling, a poll that misses backs off (and the read
still gets its bytes or its timeout), a slow reply is never polled for, and `Client` polls for
its quick verbs only."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.client import polling
from kvtier.client.polling import AWAY_S, MAX_SKIPPED_READS, ReplyPoller
from kvtier.client.reply_router import ReplyRouter
from kvtier.testing import daemon as harness


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # A read with nothing to read times out at once (as a client's SO_RCVTIMEO would, later).
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 1_000))
    yield ours, theirs
    ours.close()
    theirs.close()


class Clock:
    """The poller's clock: one microsecond a reading, or the readings a test sets."""

    def __init__(self) -> None:
        self.now = 0.0
        self.next: list[float] = []
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        self.now = self.next.pop(0) if self.next else self.now + 1e-6
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(polling, "_clock", fake)
    return fake


def miss(poller: ReplyPoller) -> None:
    """A polled read with nothing coming: the poll misses, then the sleeping read times out."""
    with pytest.raises(BlockingIOError):
        poller.recv(64, poll=True)


def read_sent(poller: ReplyPoller, theirs: socket.socket, reply: bytes) -> None:
    """The peer sends `reply`; a read asking to poll returns it."""
    theirs.sendall(reply)
    assert poller.recv(64, poll=True) == reply


def reads_skipped(poller: ReplyPoller, theirs: socket.socket) -> int:
    """Reads (each answered) that are not polled before polling resumes."""
    skipped, polls = 0, poller.polls_caught + poller.polls_missed
    while poller._reads_to_skip:
        read_sent(poller, theirs, b"skipped")
        assert poller.polls_caught + poller.polls_missed == polls  # not polled
        skipped += 1
    return skipped


def test_a_reply_already_there_is_caught_by_the_poll(pair, clock) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=100)
    read_sent(poller, theirs, b"reply")
    assert (poller.polls_caught, poller.polls_missed) == (1, 0)
    assert reads_skipped(poller, theirs) == 0


def test_a_missed_poll_sleeps_on_the_read_and_skips_the_next(pair, clock) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=100)
    miss(poller)  # polled until the deadline (100 readings of the clock), then slept
    assert poller.polls_missed == 1 and clock.readings > 100
    assert reads_skipped(poller, theirs) == 1
    read_sent(poller, theirs, b"polled again")
    assert (poller.polls_caught, poller.polls_missed) == (1, 1)


def test_misses_double_the_reads_skipped_and_catches_halve_them(pair, clock) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=100)
    skipped = []
    for _ in range(3):
        miss(poller)
        skipped.append(reads_skipped(poller, theirs))
    assert skipped == [1, 2, 4]
    read_sent(poller, theirs, b"caught")  # 4 -> 2
    read_sent(poller, theirs, b"caught")  # 2 -> 1: no read skipped after a catch
    assert poller.polls_caught == 2
    miss(poller)
    assert reads_skipped(poller, theirs) == 2


def test_misses_in_a_row_skip_at_most_the_cap(pair, clock) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=10)
    skipped = []
    for _ in range(12):
        miss(poller)
        skipped.append(reads_skipped(poller, theirs))
    assert skipped == [2 ** i for i in range(11)] + [MAX_SKIPPED_READS]
    assert MAX_SKIPPED_READS == 2 ** 10


def test_a_reply_caught_after_the_deadline_counts_as_a_miss(pair, clock) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=100)
    clock.next = [0.0, 1.0]  # the poll starts; its thread is off the CPU for a second
    read_sent(poller, theirs, b"late")
    assert (poller.polls_caught, poller.polls_missed) == (0, 1)
    assert reads_skipped(poller, theirs) == 1


def test_a_poll_that_sees_its_thread_leave_the_cpu_stops(pair, clock) -> None:
    ours, theirs = pair
    poller = ReplyPoller(ours, poll_us=100_000)
    clock.next = [0.0, AWAY_S * 2]  # nothing yet, after a gap: the CPU went to other work
    miss(poller)
    assert clock.readings == 2  # no second poll
    assert poller.polls_missed == 1


@pytest.mark.parametrize("poll_us, poll", [(0, True), (50_000, False)])
def test_no_poll_when_off_or_not_asked(pair, clock, poll_us: float, poll: bool) -> None:
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


def test_the_client_does_not_poll_while_other_threads_wait(daemon, monkeypatch) -> None:
    others_waiting = [True]
    monkeypatch.setattr(ReplyRouter, "others_waiting",
                        property(lambda router: others_waiting[0]))
    with daemon.client("polling-threads") as client:
        asked: list[bool] = []
        read = client._poller.recv
        monkeypatch.setattr(client._poller, "recv",
                            lambda num_bytes, poll: asked.append(poll) or read(num_bytes, poll))
        client.ping()
        others_waiting[0] = False
        client.ping()
        assert asked == [False, True]
