"""Hands each reply read from a connection that threads share to the thread waiting for it.

One thread at a time reads the socket (the reader); the others sleep, each on a lock of its own.
The reader files every reply it reads and wakes only the thread whose reply it was; when its
own reply comes, it hands the reading to one thread still asleep, if any. A thread waiting for
a slow store so never holds up another thread's lookup. A condition variable notified for every
reply (what this replaced) woke every sleeping thread for each one: with 8 threads sharing a
client, 7 wake-ups a reply, each taking the GIL, and fewer lookups a second than one thread.
Verbs: `ReplyRouter.wait`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

R = TypeVar("R")


class ReplyRouter(Generic[R]):
    """Replies by request id, for any number of threads sharing one connection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reading = False  # a thread is the reader (awake, or handed the reading asleep)
        self._replies: dict[int, R] = {}  # read, not yet taken by their thread
        self._sleepers: dict[int, threading.Lock] = {}  # request id -> held until it wakes

    def wait(self, request_id: int, read_reply: Callable[[], tuple[int, R]]) -> R:
        """The reply to `request_id`: filed already, delivered by the reader, or read here
        with `read_reply` (the next reply's id and reply) when no other thread reads.

        Raises:
            whatever `read_reply` raises, in the thread that was reading (the reading passes
                to a sleeping thread, which reads, and raises in turn if the connection broke).
        """
        with self._lock:
            reply = self._replies.pop(request_id, None)
            if reply is not None:
                return reply
            wake = None
            if self._reading:
                wake = threading.Lock()
                wake.acquire()
                self._sleepers[request_id] = wake
            else:
                self._reading = True
        if wake is not None:
            try:
                wake.acquire()  # released with our reply filed, or with the reading ours
            except BaseException:  # interrupted asleep: the reading must not die with us
                self._leave(request_id)
                raise
            with self._lock:
                reply = self._replies.pop(request_id, None)
            if reply is not None:
                return reply
        try:
            while True:
                reply_id, reply = read_reply()
                if reply_id == request_id:
                    return reply
                with self._lock:
                    self._replies[reply_id] = reply
                    sleeper = self._sleepers.pop(reply_id, None)
                if sleeper is not None:
                    sleeper.release()
        finally:
            self._hand_over()

    @property
    def others_waiting(self) -> bool:
        """Whether threads besides the reader wait for replies (read without the lock: a hint)."""
        return bool(self._sleepers)

    def _hand_over(self) -> None:
        """The reader is done: wake one sleeping thread to read, or leave the reading free."""
        with self._lock:
            if not self._sleepers:
                self._reading = False
                return
            _, sleeper = self._sleepers.popitem()
        sleeper.release()

    def _leave(self, request_id: int) -> None:
        """A sleeping thread interrupted: gone from the sleepers, or, if it was handed the
        reading meanwhile, handing it on."""
        with self._lock:
            if self._sleepers.pop(request_id, None) is not None:
                return  # still asleep when interrupted: its reply, if it comes, stays filed
            if self._replies.pop(request_id, None) is not None:
                return  # woken with its reply, which nobody will take now
        self._hand_over()
