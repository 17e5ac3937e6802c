"""Which verbs the service answers on the event loop: only those whose work is bounded by their
frame's size (the server sends a frame of thousands of keys off the loop whatever its verb).

Issue #24, finding 2: `unpin` was answered on the loop, and its frame (a lease id) says nothing
of its work, which is its lease's size: 16 unpins of 65,536-page leases held the loop for a
second.
"""

from __future__ import annotations

from kvtier.daemon.service import Service
from kvtier.ipc import messages as m


def test_unpin_runs_off_the_loop_and_lookup_and_pin_on_it(make_store) -> None:
    service = Service(make_store(), copy_threads=1)
    try:
        assert not service.is_inline(m.Unpin(1, 7))
        assert service.is_inline(m.Lookup(2, 1, [bytes(16)]))
        assert service.is_inline(m.Pin(3, 1, [bytes(16)], 60.0))
        assert service.is_inline(m.Ping(4))
    finally:
        service.close()
