"""S3-FIFO eviction (Yang et al., SOSP 2023): three FIFO queues and a 2-bit access counter.

New keys enter a small queue S (10% of capacity). Most are one-hit wonders and leave S in FIFO
order without ever touching the main queue M; a key hit while in S moves to M instead. M is a FIFO
with second chances: a key with a nonzero counter is decremented and requeued. A ghost queue G
remembers keys recently evicted from S so that their quick return goes straight to M.

Verbs: `on_insert` places a key in S or (after a ghost hit) M, `on_access` bumps its counter,
`on_remove` forgets it, `choose_victim` runs the S/M eviction loop.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import CanEvict, EvictionPolicy, Key

# Two bits per key in the paper: three hits are as good as more, and the cap bounds how many
# second chances a key gets in M.
_MAX_FREQ = 3

# Not deques: on_remove takes keys out of the middle, which OrderedDict does in O(1).
# Every queue runs from head (front, oldest) to tail (back, newest).
_KeyQueue = OrderedDict[Key, None]


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO over `capacity_pages` resident keys, with a ghost queue as long as M."""

    name = "s3fifo"

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages)
        self.small_capacity_pages = max(1, capacity_pages // 10)
        self.ghost_capacity_keys = capacity_pages - self.small_capacity_pages
        self._small: _KeyQueue = OrderedDict()
        self._main: _KeyQueue = OrderedDict()
        self._ghost: _KeyQueue = OrderedDict()
        self._key_to_freq: dict[Key, int] = {}

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Make `key` resident: into M if G remembers it, else S. A resident key is a hit."""
        if key in self._key_to_freq:
            self.on_access(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._key_to_freq[key] = 0

    def on_access(self, key: Key) -> None:
        """Bump a resident key's counter, saturating at 3; unknown keys are ignored."""
        freq = self._key_to_freq.get(key)
        if freq is not None:
            self._key_to_freq[key] = min(freq + 1, _MAX_FREQ)

    def on_remove(self, key: Key) -> None:
        """Forget `key`, leaving no ghost; unknown keys are ignored."""
        self._small.pop(key, None)
        self._main.pop(key, None)
        self._ghost.pop(key, None)
        self._key_to_freq.pop(key, None)

    def choose_victim(self, can_evict: CanEvict) -> Key | None:
        """Evict and return one key, or None when every resident key is pinned.

        Evict from S while S is at its target size (or M is empty), else from M. Hit keys in S
        move to M; hit keys in M are requeued with one hit less. Pinned keys go to their queue's
        tail unchanged, and a queue whose every key has been skipped so is left for the other.
        """
        # Counted per queue and reset whenever the queue changes other than by a pinned
        # rotation: promotions and decrements are finite, so the loop ends, and a count equal to
        # the queue's length means each of its keys was pinned at its last look.
        num_small_pinned = 0
        num_main_pinned = 0
        while True:
            small_exhausted = num_small_pinned >= len(self._small)
            main_exhausted = num_main_pinned >= len(self._main)
            if small_exhausted and main_exhausted:
                return None
            use_small = not small_exhausted and (
                len(self._small) >= self.small_capacity_pages or main_exhausted
            )
            if use_small:
                key, _ = self._small.popitem(last=False)
                if self._key_to_freq[key] > 0:
                    self._key_to_freq[key] = 0
                    self._main[key] = None
                    num_small_pinned = 0
                    num_main_pinned = 0
                elif can_evict(key):
                    del self._key_to_freq[key]
                    self._remember_ghost(key)
                    return key
                else:
                    self._small[key] = None
                    num_small_pinned += 1
            else:
                key, _ = self._main.popitem(last=False)
                freq = self._key_to_freq[key]
                if freq > 0:
                    self._key_to_freq[key] = freq - 1
                    self._main[key] = None
                    num_main_pinned = 0
                elif can_evict(key):
                    # Not ghosted: G exists to catch keys S dropped too early, not M's leavers.
                    del self._key_to_freq[key]
                    return key
                else:
                    self._main[key] = None
                    num_main_pinned += 1

    def _remember_ghost(self, key: Key) -> None:
        self._ghost[key] = None
        while len(self._ghost) > self.ghost_capacity_keys:
            self._ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self._key_to_freq)

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_freq
