"""The policies' bookkeeping for a store or a recall, done while its bytes are copied.

A copy leaves the GIL free (a memcpy, or a wait on a copy lane), and the policies' bookkeeping
for the same pages holds it: a few microseconds a page for the prefix-aware policies, the
default's included. One after the other, they add up; on a thread of their own, started before
the copy, the bookkeeping is done while the copy runs:

- a store's wave is filed in the host policy still WRITING (`Residency.filed`): no policy
  evicts it (victims are READY pages only), and the commit takes the filed pages that failed or
  were deleted meanwhile out of the policy again;
- a recall's hits are counted (`Planner.count_hits`) while their reader counts keep them.

The caller waits for the bookkeeping before its commit, so the commit and what follows see the
policies as they were before. Small requests are done on the caller's thread, as before: a
hand-over to a thread costs about 25 us here, and the copy it would hide in is short.

Verbs: `file_wave`, `count_hits` (each returns the work to wait for, or None when it was done
at once or is left to the commit), `close`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.store.pages import PageEntry
from kvtier.store.parts import StoreParts
from kvtier.store.planner import RecallPlan

# Bookkeeping runs during the copy from this many pages and bytes on: below, the hand-over to
# the thread costs about what it hides.
MIN_PAGES = 16
MIN_BYTES = 1 << 20


class PolicyFiler:
    """One thread that does the policies' bookkeeping of big requests under the store's lock,
    started on the first."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts
        self._thread: ThreadPoolExecutor | None = None

    def file_wave(self, entries: list[PageEntry]) -> Future[None] | None:
        """Start filing `entries` (a store's wave of new host pages, about to be copied); None
        when the wave is too small to be worth it (its commit files it)."""
        if not entries or not _worth_it(len(entries), entries[0].namespace.page_bytes):
            return None
        planner = self._parts.planner
        return self._start(lambda: planner.file_early(entries))

    def count_hits(self, plan: RecallPlan, page_bytes: int) -> Future[None] | None:
        """Start counting the hits of `plan` (a recall's, about to be copied), or count them now
        when they are few (None). The caller holds the store's lock."""
        planner = self._parts.planner
        if not _worth_it(sum(map(len, plan.hits.values())), page_bytes):
            planner.count_hits(plan)
            return None
        return self._start(lambda: planner.count_hits(plan))

    def close(self) -> None:
        """Finish the work under way and stop the thread (idempotent). Not under the store's
        lock: the work takes it."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def _start(self, work: Callable[[], None]) -> Future[None]:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-filing")
        return self._thread.submit(self._run, work)

    def _run(self, work: Callable[[], None]) -> None:
        parts = self._parts
        with parts.lock:
            work()
        parts.placement.tidy_policies()  # what the policies deferred: during the copy as well


def _worth_it(num_pages: int, page_bytes: int) -> bool:
    return num_pages >= MIN_PAGES and num_pages * page_bytes >= MIN_BYTES
