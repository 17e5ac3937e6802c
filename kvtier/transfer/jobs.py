"""Transfer jobs: what a lane moves (`PoolPageIds` <-> arena slots) and how callers wait on it.

A `LaneJob` is one store (d2h: pool pages -> host arena slots) or recall (h2d: slots -> pool pages).
It carries an optional `ready` condition the lane honours before reading or writing pool memory,
and completes once its bytes have landed. Verbs: `LaneJob.result`, `LaneJob.wait`, `LaneJob.done`,
`LaneJob.failed_keys`, `LaneJob.add_done_callback`; `check_entries` validates a submission.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.errors import ProtocolError, TransferError
from kvtier.pools.layout import PoolMemory


class Direction(enum.Enum):
    """Which way a lane moves bytes."""

    D2H = "d2h"  # store: engine pool -> host arena
    H2D = "h2d"  # recall: host arena -> engine pool


# Page ids or slot offsets: a list, or an int64 array (what the store and `rotate` pass).
Indices = Sequence[int] | npt.NDArray[np.int64]


@dataclass(slots=True, frozen=True)
class PoolPageIds:
    """Pages `page_ids` of one pool: the engine side of a job."""

    pool: PoolMemory
    page_ids: Indices


# A ready condition: None (go now), a threading.Event, another LaneJob (go once it is done), a
# callable polled until it returns True, or on CUDA a device event the lane's stream waits on.
Ready = object


class LaneJob:
    """One store or recall moving `keys[i]` between pool page `page_ids[i]` and
    `slot_offsets[i]`."""

    __slots__ = ("direction", "pool", "page_ids", "slot_offsets", "keys", "ready", "_done",
                 "_failed", "_reasons", "_callbacks", "_lock")

    def __init__(self, direction: Direction, pages: PoolPageIds, slot_offsets: Indices,
                 keys: Sequence[bytes], ready: Ready | None = None) -> None:
        self.direction = direction
        self.pool = pages.pool
        self.page_ids = np.asarray(pages.page_ids, dtype=np.int64)
        self.slot_offsets = np.asarray(slot_offsets, dtype=np.int64)
        self.keys = list(keys)
        self.ready = ready
        self._done = threading.Event()
        self._failed: list[int] = []
        self._reasons: list[str] = []
        self._callbacks: list[Callable[[LaneJob], None]] = []
        self._lock = threading.Lock()

    @property
    def num_pages(self) -> int:
        """Pages this job moves."""
        return len(self.keys)

    def done(self) -> bool:
        """Whether the job finished (moved or failed)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the job finished; False if `timeout_s` passed first."""
        return self._done.wait(timeout_s)

    def failed_keys(self) -> list[bytes]:
        """Keys whose bytes were not moved (valid once `done()`), in submission order."""
        return [self.keys[i] for i in sorted(set(self._failed))]

    def result(self, timeout_s: float | None = None) -> list[bytes]:
        """Wait for the job and return its keys, all moved.

        Raises:
            TransferError: some copies failed; `failed_keys` names exactly those keys.
            TimeoutError: `timeout_s` passed before the job finished.
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"{self.direction.value} job of {self.num_pages} pages "
                               f"still running")
        failed = self.failed_keys()
        if failed:
            raise TransferError(f"{self.direction.value}: {len(failed)} of {self.num_pages} pages "
                                f"not moved: {self._reasons[0]}", failed)
        return list(self.keys)

    def add_done_callback(self, callback: Callable[[LaneJob], None]) -> None:
        """Call `callback(job)` once done (at once if already done), on the finishing thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def finish(self, failed_indices: Sequence[int] = (), reason: str = "") -> None:
        """Mark the job done, pages `failed_indices` not moved (the lane's side)."""
        self._failed.extend(int(i) for i in failed_indices)
        if reason:
            self._reasons.append(reason)
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


def check_entries(pages: PoolPageIds, slot_offsets: Indices, keys: Sequence[bytes],
                  arena_bytes: int) -> None:
    """Reject a submission whose lists disagree or whose pages or slots are out of range.

    Raises:
        ProtocolError: naming the first bad value.
    """
    layout = pages.pool.layout
    ids = np.asarray(pages.page_ids, dtype=np.int64)
    slots = np.asarray(slot_offsets, dtype=np.int64)
    if not len(ids) == len(slots) == len(keys):
        raise ProtocolError(f"{len(keys)} keys, {len(ids)} page ids and {len(slots)} slots: "
                            "a job needs one of each per page")
    if len(ids) == 0:
        return
    bad_ids = ids[(ids < 0) | (ids >= layout.num_pages)]
    if len(bad_ids):
        raise ProtocolError(f"page id {int(bad_ids[0])} is out of range: the pool has "
                            f"{layout.num_pages} pages")
    bad_slots = slots[(slots < 0) | (slots + layout.page_bytes > arena_bytes)]
    if len(bad_slots):
        raise ProtocolError(f"slot offset {int(bad_slots[0])} does not fit a {layout.page_bytes}"
                            f"-byte page in the {arena_bytes}-byte arena")
