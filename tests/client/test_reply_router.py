"""`ReplyRouter` on its own: replies read by whichever thread reads reach the thread that waits
for them, only that thread is woken for a reply, and the reading survives a reader's error and
an interrupted sleeper."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import pytest

from kvtier.client.reply_router import ReplyRouter
from kvtier.testing import daemon as harness

Reply = tuple[int, str]


class Wire:
    """Replies the test puts, read one at a time by whichever thread reads; counts reads."""

    def __init__(self) -> None:
        self._replies: queue.Queue[Reply | BaseException] = queue.Queue()
        self.reads_started = threading.Semaphore(0)

    def put(self, request_id: int) -> None:
        self._replies.put((request_id, f"reply {request_id}"))

    def fail(self, error: BaseException) -> None:
        self._replies.put(error)

    def read(self) -> Reply:
        self.reads_started.release()
        item = self._replies.get(timeout=60)
        if isinstance(item, BaseException):
            raise item
        return item


def waiting_thread(router: ReplyRouter[str], request_id: int, read: Callable[[], Reply],
                   results: dict[int, object]) -> threading.Thread:
    def run() -> None:
        try:
            results[request_id] = router.wait(request_id, read)
        except BaseException as exc:
            results[request_id] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def asleep(router: ReplyRouter[str], *request_ids: int) -> None:
    """Until each of `request_ids` waits on its own lock."""
    harness.wait_until(lambda: all(i in router._sleepers for i in request_ids),
                       f"threads {request_ids} asleep", timeout_s=60)


def test_each_reply_reaches_its_own_thread_whoever_reads() -> None:
    router: ReplyRouter[str] = ReplyRouter()
    wire = Wire()
    results: dict[int, object] = {}
    reader = waiting_thread(router, 1, wire.read, results)
    assert wire.reads_started.acquire(timeout=60)  # thread 1 reads
    sleepers = [waiting_thread(router, i, wire.read, results) for i in (2, 3)]
    asleep(router, 2, 3)
    for request_id in (3, 2, 1):  # others' replies first: the reader hands them over
        wire.put(request_id)
    for thread in [reader, *sleepers]:
        thread.join(60)
    assert results == {1: "reply 1", 2: "reply 2", 3: "reply 3"}
    assert not router._reading and not router._sleepers and not router._replies


def test_others_waiting_while_a_thread_sleeps_on_its_reply() -> None:
    router: ReplyRouter[str] = ReplyRouter()
    wire = Wire()
    results: dict[int, object] = {}
    reader = waiting_thread(router, 1, wire.read, results)
    assert wire.reads_started.acquire(timeout=60)
    assert not router.others_waiting  # the reader alone
    sleeper = waiting_thread(router, 2, wire.read, results)
    asleep(router, 2)
    assert router.others_waiting
    wire.put(2)
    sleeper.join(60)
    assert not router.others_waiting
    wire.put(1)
    reader.join(60)
    assert results == {1: "reply 1", 2: "reply 2"}


def test_a_reply_wakes_only_its_thread() -> None:
    """Thread 2's reply leaves thread 3 asleep, whichever went to sleep first (a condition
    notified for every reply woke every waiting thread)."""
    for first, second in ((2, 3), (3, 2)):
        router: ReplyRouter[str] = ReplyRouter()
        wire = Wire()
        results: dict[int, object] = {}
        reader = waiting_thread(router, 1, wire.read, results)
        assert wire.reads_started.acquire(timeout=60)
        sleepers = {}
        for request_id in (first, second):
            sleepers[request_id] = waiting_thread(router, request_id, wire.read, results)
            asleep(router, request_id)
        wire.put(2)
        sleepers[2].join(60)
        assert results == {2: "reply 2"}
        assert 3 in router._sleepers and router._sleepers[3].locked()
        wire.put(1)
        wire.put(3)
        for thread in (reader, sleepers[3]):
            thread.join(60)
        assert results == {1: "reply 1", 2: "reply 2", 3: "reply 3"}


def test_the_reading_passes_on_when_the_reader_fails() -> None:
    """The reader's error is its own; a sleeping thread takes the reading over and gets its
    reply (or the connection's next error)."""
    router: ReplyRouter[str] = ReplyRouter()
    wire = Wire()
    results: dict[int, object] = {}
    reader = waiting_thread(router, 1, wire.read, results)
    assert wire.reads_started.acquire(timeout=60)
    sleeper = waiting_thread(router, 2, wire.read, results)
    asleep(router, 2)
    wire.fail(TimeoutError("no answer"))
    reader.join(60)
    assert isinstance(results[1], TimeoutError)
    assert wire.reads_started.acquire(timeout=60)  # thread 2 reads now
    wire.put(2)
    sleeper.join(60)
    assert results[2] == "reply 2"
    assert not router._reading


def test_an_interrupted_sleeper_handed_the_reading_hands_it_on() -> None:
    """A thread interrupted (KeyboardInterrupt) just as the reading was handed to it must not
    take the reading with it: the next thread reads."""
    router: ReplyRouter[str] = ReplyRouter()
    wire = Wire()
    results: dict[int, object] = {}
    router._reading = True  # another thread reads
    interrupted = threading.Lock()
    interrupted.acquire()
    router._sleepers[7] = interrupted  # thread 7 asleep on it...
    sleeper = waiting_thread(router, 8, wire.read, results)
    asleep(router, 8)
    router._sleepers.pop(7)  # ...is handed the reading (as `_hand_over` does) and interrupted
    router._leave(7)
    assert wire.reads_started.acquire(timeout=60)  # thread 8 was woken to read
    wire.put(8)
    sleeper.join(60)
    assert results == {8: "reply 8"}
    assert not router._reading and not router._sleepers


def test_a_filed_reply_is_taken_without_reading() -> None:
    router: ReplyRouter[str] = ReplyRouter()
    router._reading = True  # another thread reads
    router._replies[5] = "reply 5"
    assert router.wait(5, lambda: pytest.fail("nothing to read")) == "reply 5"
    assert router._reading and not router._replies
