"""A lane: one worker thread moving every queued job of one direction, tick after tick.

Each tick takes ALL queued jobs whose ready condition holds and hands them to the backend's mover
as one batch, so many small jobs become few large copies. Jobs still waiting on their ready
condition stay queued without holding back the others. Verbs: `submit`, `close`.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from kvtier.transfer.jobs import Direction, LaneJob

# How long a lane sleeps before polling ready conditions that cannot notify it (events, callables).
READY_POLL_S = 0.0005


class Mover(Protocol):
    """A backend's copy engine for one direction."""

    def move(self, jobs: list[LaneJob]) -> None:
        """Move every job's pages, then `finish` each job (naming failed pages)."""

    def is_device_ready(self, ready: object) -> bool:
        """Whether `ready` is a device-side condition the mover orders its copies after."""

    def close(self) -> None:
        """Release streams and staging buffers."""


def is_host_ready(ready: object, mover: Mover) -> bool:
    """Whether a job's ready condition lets the lane start it now."""
    if ready is None:
        return True
    if isinstance(ready, LaneJob):
        return ready.done()
    if isinstance(ready, threading.Event):
        return ready.is_set()
    if mover.is_device_ready(ready):
        return True  # the mover makes its stream wait on it: no host wait
    assert callable(ready), "submit checks ready conditions"
    return bool(ready())


class Lane:
    """One direction's worker thread, its queue and its backend mover."""

    def __init__(self, direction: Direction, mover: Mover) -> None:
        self.direction = direction
        self.mover = mover
        self.num_ticks = 0
        self.bytes_moved = 0
        self.busy_s = 0.0
        self._queue: list[LaneJob] = []
        self._wakeup = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-lane-{direction.value}",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: LaneJob) -> None:
        """Queue `job` for the next tick."""
        with self._wakeup:
            if self._closing:
                job.finish(range(job.num_pages), "the transfer engine is closed")
                return
            self._queue.append(job)
            self._wakeup.notify()
        if isinstance(job.ready, LaneJob):  # wake the lane when its dependency finishes
            job.ready.add_done_callback(self._notify)

    def _notify(self, _: LaneJob) -> None:
        with self._wakeup:
            self._wakeup.notify()

    def _take_ready(self) -> list[LaneJob] | None:
        """Every queued job that may start now; None once closing and drained."""
        with self._wakeup:
            while True:
                self._fail_orphans()
                ready = [job for job in self._queue if is_host_ready(job.ready, self.mover)]
                if ready:
                    taken = {id(job) for job in ready}
                    self._queue = [job for job in self._queue if id(job) not in taken]
                    return ready
                if self._closing and not self._queue:
                    return None
                self._wakeup.wait(READY_POLL_S if self._queue else None)

    def _fail_orphans(self) -> None:
        """Fail queued jobs whose dependency job failed: their destination was not freed."""
        orphans = [job for job in self._queue
                   if isinstance(job.ready, LaneJob) and job.ready.done()
                   and job.ready.failed_keys()]
        for job in orphans:
            self._queue.remove(job)
            job.finish(range(job.num_pages), "the copy this job waited on failed")

    def _run(self) -> None:
        while (jobs := self._take_ready()) is not None:
            started = time.perf_counter()
            try:
                self.mover.move(jobs)
            except Exception as exc:  # a mover bug must still fail its jobs by key, not hang them
                for job in jobs:
                    if not job.done():
                        job.finish(range(job.num_pages), f"{type(exc).__name__}: {exc}")
            self.busy_s += time.perf_counter() - started
            self.num_ticks += 1
            self.bytes_moved += sum(job.num_pages * job.pool.layout.page_bytes for job in jobs)
            del jobs  # while the lane waits, a finished tick must not keep its pools mapped

    def close(self, timeout_s: float | None = None) -> None:
        """Finish queued jobs, stop the thread, release the mover (idempotent)."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join(timeout_s)
        self.mover.close()


