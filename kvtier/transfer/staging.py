"""A ring of staging buffers, each reused only after the copies that read or write it finished.

A lane takes buffers in turn; each handed back carries a fence (a CUDA event, or anything with
`synchronize()`) and an optional completion step to run once the fence passed (a store's host-side
copy out of pinned staging). `acquire` of a buffer still in flight waits for its fence first, so a
buffer is never overwritten while a DMA or kernel may still touch it. Verbs: `acquire`, `release`,
`drain`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

Buffer = TypeVar("Buffer")


class Fence(Protocol):
    """Something that completes: `cupy.cuda.Event`, or a test's fake."""

    def synchronize(self) -> None:
        """Block until the work recorded before it finished."""


@dataclass(slots=True)
class _InFlight:
    index: int
    fence: Fence
    on_complete: Callable[[], None] | None


class StagingRing(Generic[Buffer]):
    """`buffers` handed out round-robin; never one whose last use has not completed."""

    def __init__(self, buffers: list[Buffer]) -> None:
        if not buffers:
            raise ValueError("a staging ring needs at least one buffer")
        self.buffers = buffers
        self._next = 0
        self._in_flight: deque[_InFlight] = deque()  # oldest first: buffers complete in order
        self._busy: set[int] = set()
        self.num_waits = 0

    def acquire(self) -> tuple[int, Buffer]:
        """The next buffer, after completing its previous use if that is still in flight."""
        index = self._next
        self._next = (index + 1) % len(self.buffers)
        while index in self._busy:
            self.num_waits += 1
            self._complete_oldest()
        return index, self.buffers[index]

    def release(self, index: int, fence: Fence,
                on_complete: Callable[[], None] | None = None) -> None:
        """Mark buffer `index` in flight until `fence`; then run `on_complete`."""
        assert index not in self._busy, "a staging buffer was released twice"
        self._busy.add(index)
        self._in_flight.append(_InFlight(index, fence, on_complete))

    def drain(self) -> None:
        """Complete every buffer in flight, oldest first."""
        while self._in_flight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        entry = self._in_flight[0]
        try:
            entry.fence.synchronize()
            if entry.on_complete is not None:
                entry.on_complete()
        finally:  # a failed completion still frees the buffer: its fence has passed
            self._in_flight.popleft()
            self._busy.discard(entry.index)
