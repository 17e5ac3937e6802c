"""Dicts that give back the room of the keys they lost.

A CPython dict never shrinks as keys leave it: only an insertion that needs more room resizes
it. A daemon that held 65,536 pages once and then deleted them kept 8 empty tables of 2.5-3.5
MiB each for ever (the page table, the slot maps, the policy's tree, pending admissions and
reuse history, the lookup index's slot map): 20 MiB of its heap. `shrink` rebuilds a dict whose
table is many times what its keys need, in place (everyone holding it keeps the same object),
in time proportional to the keys left: call it where no other thread reads the dict (under the
lock that guards it).
Verbs: `shrink`, `shrink_attributes`, `is_oversized`.
"""

from __future__ import annotations

import sys
from typing import Any

# A dict's table holds its keys at 1/3 to 2/3 of its slots: 30 to 60 bytes a key in CPython
# 3.11. Rebuilt only when it is many times that: a few rebuilds for a dict that empties, none
# for one that merely breathes.
_BYTES_PER_KEY = 72
_OVERSIZE_FACTOR = 8
_SMALL_BYTES = 64 << 10  # under this a table is not worth a rebuild
# A rebuild copies the keys left under the caller's lock (about 1.5 ms for 8,192 keys, freeing
# the old table included): past this many the stall outweighs what a table that full gives back.
MAX_KEYS_TO_REBUILD = 1 << 13


def is_oversized(table: dict[Any, Any]) -> bool:
    """Whether `table` takes many times the memory its keys need."""
    size_bytes = sys.getsizeof(table)
    return (size_bytes > _SMALL_BYTES and len(table) <= MAX_KEYS_TO_REBUILD
            and size_bytes > _OVERSIZE_FACTOR * _BYTES_PER_KEY * len(table))


def shrink(table: dict[Any, Any]) -> int:
    """Rebuild `table` in place at the size its keys need, order kept, if it is oversized; the
    bytes given back (0 when left alone). Goes through `clear` and `update`, which a dict
    subclass may watch (an `OrderedDict` keeps its order; `PageTable` reports nothing)."""
    if not is_oversized(table):
        return 0
    before_bytes = sys.getsizeof(table)
    items = list(table.items())
    table.clear()
    table.update(items)
    return max(0, before_bytes - sys.getsizeof(table))


def shrink_attributes(owner: object) -> int:
    """`shrink` every dict among `owner`'s attributes (its `__dict__` and slots); the bytes
    given back. Its parts' dicts are theirs to shrink."""
    values = list(vars(owner).values()) if hasattr(owner, "__dict__") else []
    for cls in type(owner).__mro__:
        values += [getattr(owner, name) for name in getattr(cls, "__slots__", ())
                   if hasattr(owner, name)]
    return sum(shrink(value) for value in values if isinstance(value, dict))
