"""Reading a quick reply by polling the socket for a moment before sleeping on it.

A thread blocked in `recv` sleeps, and its CPU with it; the reply must then wake both, and on a
VM waking an idle virtual CPU costs more than the daemon's whole answer to a small request. A
one-key lookup across the two CPUs of a 2-core VM: 156-179 us p50 with a blocking read, 69-97
with the reply polled for (`python bench/bench_ipc.py`: `lookup_*`, `lookup_blocking_*`). So the
read of a reply expected soon (a lookup, a pin, a ping: `Client._run`) first polls, `recv` with
`MSG_DONTWAIT`, for up to `poll_us`, yielding the CPU between polls (a daemon on the same CPU
then runs at once), and sleeps as before if nothing came. A store's or recall's completion is
never polled for: it comes after a copy.

Polling pays only on a CPU with nothing else to run. On a busy node a poller is a CPU consumer
like any other and loses the quick wake-up the scheduler gives a sleeper: a poll that saw its
thread leave the CPU (a gap between two polls, or a reply caught after the deadline) counts as
a miss, like one that found nothing. A miss turns polling off for the next read, then for twice
as many after each further miss (up to `MAX_SKIPPED_READS`); a poll that catches its reply in
time halves that again.
Verbs: `ReplyPoller.recv`.
"""

from __future__ import annotations

import os
import socket
import time

# How long a read polls before sleeping: above a quick answer across CPUs (30-60 us here),
# well below the time a sleeping thread takes to wake on a busy node.
DEFAULT_POLL_US = 100.0
# Past this a poll costs more than any sleeping thread's wake-up: the engines' settings refuse
# more as a typo.
MAX_POLL_US = 10_000.0
MAX_SKIPPED_READS = 1024
# A gap this long between two polls (each takes a microsecond or two): the thread was off its
# CPU, which went to other work.
AWAY_S = 30e-6
_clock = time.perf_counter  # tests replace it


class ReplyPoller:
    """Reads of one socket, polled for up to `poll_us` when asked (0: never polls).

    One thread reads at a time (the client's reply router sees to it), so no lock.
    """

    def __init__(self, sock: socket.socket, poll_us: float = DEFAULT_POLL_US) -> None:
        if poll_us < 0:
            raise ValueError(f"poll_us must be >= 0, not {poll_us}")
        self._sock = sock
        self._poll_s = poll_us / 1e6
        self._skip_after_miss = 0  # reads not polled after a miss: doubled a miss, halved a catch
        self._reads_to_skip = 0
        self.polls_caught = 0  # for tests and benches: polls that got their bytes in time
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
        recv, flags, give_way, clock = self._sock.recv, socket.MSG_DONTWAIT, os.sched_yield, _clock
        now = clock()
        deadline = now + self._poll_s
        while True:
            try:
                chunk = recv(num_bytes, flags)
            except BlockingIOError:
                before, now = now, clock()
                if now < deadline and now - before < AWAY_S:
                    give_way()
                    continue
                self._missed()  # nothing in time, or nothing yet after the CPU went elsewhere
                return None
            if clock() > deadline:  # caught, but late: the CPU went to other work meanwhile
                self._missed()
            else:
                self.polls_caught += 1
                self._skip_after_miss //= 2
            return chunk

    def _missed(self) -> None:
        self.polls_missed += 1
        self._skip_after_miss = min(max(1, 2 * self._skip_after_miss), MAX_SKIPPED_READS)
        self._reads_to_skip = self._skip_after_miss
