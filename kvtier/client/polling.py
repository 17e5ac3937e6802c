"""Reading a quick reply by polling the socket for a moment before sleeping on it.

A thread blocked in `recv` sleeps, and its CPU with it; the reply must then wake both, and on a
VM waking an idle virtual CPU costs more than the daemon's whole answer to a small request. A
one-key lookup across the two CPUs of a 2-core VM: 132-148 us p50 with a blocking read, 48-55
with the reply polled for (`python bench/bench_ipc.py`: `lookup_*` and `poll_echo_*`). So the
read of a reply expected soon (a lookup, a pin, a ping: `Client._run`) first polls, `recv` with
`MSG_DONTWAIT`, for up to `poll_us`, then sleeps as before. A store's or recall's completion
is never polled for: it comes after a copy.

The waste is bounded: a poll that ends with nothing (a busy daemon, a loaded machine) turns
polling off for the next read, then for twice as many after each further miss (up to
`MAX_SKIPPED_READS`); the first poll that catches its reply turns it back on for every read.
Verbs: `ReplyPoller.recv`.
"""

from __future__ import annotations

import os
import socket
import time

# How long a read polls before sleeping: above a quick answer across CPUs (30-60 us here),
# well below the time a sleeping thread takes to wake on a busy node.
DEFAULT_POLL_US = 100.0
MAX_SKIPPED_READS = 64


class ReplyPoller:
    """Reads of one socket, polled for up to `poll_us` when asked (0: never polls).

    One thread reads at a time (the client's reply router sees to it), so no lock.
    """

    def __init__(self, sock: socket.socket, poll_us: float = DEFAULT_POLL_US) -> None:
        if poll_us < 0:
            raise ValueError(f"poll_us must be >= 0, not {poll_us}")
        self._sock = sock
        self._poll_s = poll_us / 1e6
        self._skip_after_miss = 0  # reads not polled after the last miss, doubled per miss
        self._reads_to_skip = 0
        self.polls_caught = 0  # for tests and stats: polls that got their bytes
        self.polls_missed = 0

    def recv(self, num_bytes: int, poll: bool) -> bytes:
        """Up to `num_bytes` received; polled for first when `poll` and polling is on.

        Raises:
            BlockingIOError: the socket's receive timeout ran out (a sleeping read's).
        """
        if poll and self._poll_s:
            if self._reads_to_skip:
                self._reads_to_skip -= 1
            else:
                chunk = self._poll(num_bytes)
                if chunk is not None:
                    return chunk
        return self._sock.recv(num_bytes)

    def _poll(self, num_bytes: int) -> bytes | None:
        recv, flags, give_way = self._sock.recv, socket.MSG_DONTWAIT, os.sched_yield
        deadline = time.perf_counter() + self._poll_s
        while True:
            try:
                chunk = recv(num_bytes, flags)
            except BlockingIOError:
                if time.perf_counter() < deadline:
                    give_way()
                    continue
                self.polls_missed += 1
                self._skip_after_miss = min(max(1, 2 * self._skip_after_miss),
                                            MAX_SKIPPED_READS)
                self._reads_to_skip = self._skip_after_miss
                return None
            self.polls_caught += 1
            self._skip_after_miss = 0
            return chunk
