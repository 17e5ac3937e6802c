"""The daemon's Python heap: garbage collection that never stalls the loop, memory given back.

A daemon holding 65,536 pages holds some 300,000 Python objects (page table entries, policy
nodes), and CPython's full collection walks every one of them with the GIL held: 75 ms here,
each time the heap grew by a quarter (several times during one large store), and again at every
burst of allocations afterwards (a Prometheus scrape). Every client's round trip waited for it.
So objects that lived through the young collections are moved out of the collector's sight
(`gc.freeze`, O(1)) every `FREEZE_INTERVAL_S`: a collection then walks only what is younger.
Cyclic garbage among frozen objects is found only by a sweep of the whole heap, the one full walk
left, and it runs only where garbage is evident: what the daemon lets go and expects reference
counting to free (a closed connection, its session) is `watch`ed, and one still alive
`WATCH_GRACE_S` later is held by a cycle, so the next tend sweeps (at most once every
`MIN_SWEEP_INTERVAL_S`, whatever the churn). A sweep every `SWEEP_INTERVAL_S` remains as the
backstop for cycles nobody watched.

`give_memory_back` returns the C heap's freed memory (malloc_trim) after large requests (the
store's emptied tables first shrunk: `PageStore.shrink`, the interpreter's free lists emptied),
and `give_arena_memory_back` the host arena's chunks whose pages all went.
Verbs: `HeapKeeper.tend`, `HeapKeeper.watch`, `HeapKeeper.freeze_survivors`, `give_memory_back`,
`give_arena_memory_back`.
"""

from __future__ import annotations

import ctypes
import gc
import time
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.store.page_store import PageStore

FREEZE_INTERVAL_S = 0.1
# A full walk costs about 0.25 µs an object with the GIL held (75 ms at 65,536 pages): CPython's
# automatic ones came at every quarter's growth of the heap; the backstop comes once an hour.
SWEEP_INTERVAL_S = 3600.0
WATCH_GRACE_S = 5.0  # a connection's last callbacks run well within this after it closed
MIN_SWEEP_INTERVAL_S = 60.0
MAX_WATCHED = 4096  # the oldest watches go first: a bound, whatever the churn
# A chunk emptied goes back to the system only after this long unused: a delete followed at once
# by stores (a client replacing its pages, a bench's rounds) would otherwise fault its memory in
# again under the store (512 MiB: 0.44 s here, against the store's own 0.045 s).
IDLE_CHUNK_GRACE_S = 5.0


class HeapKeeper:
    """Freezes the survivors of young collections; sweeps the whole heap rarely.

    Args:
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_sweep_s = clock()
        self._watched: deque[tuple[float, weakref.ref[object]]] = deque(maxlen=MAX_WATCHED)
        self.num_sweeps = 0

    def watch(self, obj: object) -> None:
        """`obj` was let go and should die by reference counting: if it is still alive
        WATCH_GRACE_S from now, a cycle holds it, and a sweep is due. An object that takes no
        weak reference (a tuple) holds no cycle of its own and is not watched."""
        try:
            ref = weakref.ref(obj)
        except TypeError:
            return
        self._watched.append((self._clock(), ref))

    def _garbage_evident(self, now: float) -> bool:
        """Whether a watched object outlived its grace (the dead ones are forgotten)."""
        while self._watched and self._watched[0][1]() is None:
            self._watched.popleft()
        return bool(self._watched) and now - self._watched[0][0] >= WATCH_GRACE_S

    def freeze_survivors(self) -> None:
        """Collect the young generations (what they hold is few: their thresholds bound it),
        then freeze what survived: the next collections never walk it again."""
        gc.collect(1)
        gc.freeze()

    def tend(self) -> None:
        """Every FREEZE_INTERVAL_S, on the loop: freeze survivors; sweep every frozen object
        where a watched one outlived its grace, or once every SWEEP_INTERVAL_S."""
        now = self._clock()
        since = now - self._last_sweep_s
        if since >= SWEEP_INTERVAL_S or (since >= MIN_SWEEP_INTERVAL_S
                                         and self._garbage_evident(now)):
            self._last_sweep_s = now
            self.num_sweeps += 1
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            # What the sweep freed is gone; what it could not free is a leak, not a cycle:
            # watched again, it would call a sweep a minute for ever.
            self._watched = deque(((at, ref) for at, ref in self._watched
                                   if ref() is not None and now - at < WATCH_GRACE_S),
                                  maxlen=MAX_WATCHED)
            return
        self.freeze_survivors()


def give_memory_back() -> None:
    """Return the heap memory freed since (the page table entries and buffers of a request of
    65,536 keys) to the system: glibc keeps freed memory mapped, and a daemon's RSS would stay
    at its largest request's peak for ever. A no-op on other C libraries."""
    # A full collection also empties the interpreter's free lists (up to 2,000 tuples of each
    # size, floats, lists, dicts): what a large request left there pins pymalloc arenas. It walks
    # the unfrozen objects only (`HeapKeeper` freezes the rest): 0.01-0.12 ms at 65,536 pages.
    gc.collect()
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)  # ctypes calls release the GIL: the loop serves meanwhile


def give_arena_memory_back(store: PageStore, idle_for_s: float = IDLE_CHUNK_GRACE_S) -> int:
    """Give the memory of every host arena chunk left with no page for `idle_for_s` back to the
    system; the number of chunks. One chunk per hold of the store's lock (a hole punched: about
    a millisecond for 8 MiB), so the requests waiting on the lock wait for one chunk at most."""
    num_chunks = 0
    while store.call_locked(partial(store.host.release_idle_chunk, idle_for_s)):
        num_chunks += 1
    return num_chunks
