"""The daemon's Python heap: garbage collection that never stalls the loop, memory given back.

A daemon holding 65,536 pages holds some 300,000 Python objects (page table entries, policy
nodes), and CPython's full collection walks every one of them with the GIL held: 75 ms here,
each time the heap grew by a quarter (several times during one large store), and again at every
burst of allocations afterwards (a Prometheus scrape). Every client's round trip waited for it.
So objects that lived through the young collections are moved out of the collector's sight
(`gc.freeze`, O(1)) every `FREEZE_INTERVAL_S`: a collection then walks only what is younger.
Cyclic garbage among frozen objects (a connection's protocol and transport, after it closes)
is found by one sweep of the whole heap every `SWEEP_INTERVAL_S`, the only full walk left.

`give_memory_back` returns the C heap's freed memory (malloc_trim) after large requests, and
`give_arena_memory_back` the host arena's chunks whose pages all went.
Verbs: `HeapKeeper.tend`, `HeapKeeper.freeze_survivors`, `give_memory_back`,
`give_arena_memory_back`.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.store.page_store import PageStore

FREEZE_INTERVAL_S = 0.1
# A full walk costs about 0.25 µs an object with the GIL held; today's automatic ones came at
# every quarter's growth of the heap, this one at most every ten minutes.
SWEEP_INTERVAL_S = 600.0


class HeapKeeper:
    """Freezes the survivors of young collections; sweeps the whole heap rarely.

    Args:
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_sweep_s = clock()

    def freeze_survivors(self) -> None:
        """Collect the young generations (what they hold is few: their thresholds bound it),
        then freeze what survived: the next collections never walk it again."""
        gc.collect(1)
        gc.freeze()

    def tend(self) -> None:
        """Every FREEZE_INTERVAL_S, on the loop: freeze survivors, and sweep every frozen object
        once every SWEEP_INTERVAL_S (garbage cycles that lived long enough to be frozen)."""
        now = self._clock()
        if now - self._last_sweep_s >= SWEEP_INTERVAL_S:
            self._last_sweep_s = now
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            return
        self.freeze_survivors()


def give_memory_back() -> None:
    """Return the heap memory freed since (the page table entries and buffers of a request of
    65,536 keys) to the system: glibc keeps freed memory mapped, and a daemon's RSS would stay
    at its largest request's peak for ever. A no-op on other C libraries."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)  # ctypes calls release the GIL: the loop serves meanwhile


def give_arena_memory_back(store: PageStore) -> int:
    """Give the memory of every host arena chunk left with no page back to the system; the
    number of chunks. One chunk per hold of the store's lock (a hole punched: about a
    millisecond for 8 MiB), so the requests waiting on the lock wait for one chunk at most."""
    num_chunks = 0
    while store.call_locked(store.host.release_idle_chunk):
        num_chunks += 1
    return num_chunks
