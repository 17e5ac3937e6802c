"""The client's pool in shared memory: an engine's pages where the daemon can copy them.

On a machine without a GPU (and in tests and CI) an engine keeps its KV pages in a sealed memfd
laid out as its `PoolLayout` (`kvtier.sealed_memory`): sized once, then sealed so that nobody can
shrink or grow it. `register` sends the descriptor to the daemon, which maps it and copies with
plain memory copies. Verbs: `SharedPool`, `SharedPool.page`, `SharedPool.register`,
`SharedPool.close`; `SegmentPool`, the same by /dev/shm name (copied by
descriptor, slower: for a client that cannot send a descriptor).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvtier.client.connection import Client
from kvtier.client.results import PoolHandle
from kvtier.errors import ProtocolError
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout
from kvtier.sealed_memory import create_sealed, map_sealed
from kvtier.shm import SharedSegment, new_segment_name


class SharedPool:
    """An engine page pool in a new sealed memfd (the CPU stand-in for device memory).

    `pages` is the `[num_pages, num_layers, 2, segment_bytes]` view the daemon also uses; `fd` is
    the memfd (`name` names it in messages); `register(client, namespace)` hands it to the
    daemon. Close it to unmap and close the memfd.
    """

    def __init__(self, layout: PoolLayout) -> None:
        layout.validate(layout.span_bytes)
        self.layout = layout
        self.name = new_segment_name("kvtier-pool")
        self.fd = create_sealed(self.name, layout.span_bytes)
        try:
            self._mapping, self.array = map_sealed(self.fd, layout.span_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.array[:: mmap.PAGESIZE] = 0  # prefault: the first copy must not pay for page faults
        self.pages = layout.page_view(self.array)

    def page(self, page_id: int) -> np.ndarray:
        """Page `page_id` as a `[num_layers, 2, segment_bytes]` view."""
        return self.pages[page_id]

    def register(self, client: Client, namespace: Namespace) -> PoolHandle:
        """Register this pool with the daemon over `client`.

        Raises:
            ProtocolError: the namespace's pages are not this pool's size.
            DaemonReplyError: the daemon refused the pool.
        """
        _check_page_bytes(namespace, self.layout)
        return client.register_sealed_pool(namespace, self.fd, self.layout, self.name)

    def close(self) -> None:
        """Unmap the pool and close its memfd (idempotent); the memory goes once the daemon
        lets go of its mapping too."""
        self.pages = np.empty(0, np.uint8)
        self.array = np.empty(0, np.uint8)
        try:
            self._mapping.close()
        except BufferError:  # a caller still holds a view: unmapped when that view goes
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_page_bytes(namespace: Namespace, layout: PoolLayout) -> None:
    """Refuse a namespace whose pages are not the pool's size (both pool kinds register so)."""
    if namespace.page_bytes != layout.page_bytes:
        raise ProtocolError(f"namespace pages are {namespace.page_bytes} bytes, this pool's "
                            f"are {layout.page_bytes}")


class SegmentPool:
    """A pool in a named /dev/shm segment, registered by name: for a client that cannot send a
    descriptor over the socket. The daemon cannot map it safely (its client may shrink it), so
    it copies by descriptor with preadv/pwritev, at about half of memcpy speed: prefer
    `SharedPool`. Same `pages`, `page`, `register` and `close` as `SharedPool`; `segment` is the
    segment.
    """

    def __init__(self, layout: PoolLayout) -> None:
        layout.validate(layout.span_bytes)
        self.layout = layout
        self.segment = SharedSegment.create(new_segment_name("kvtier-pool"), layout.span_bytes)
        self.segment.prefault()
        self.name = self.segment.name
        self.pages = layout.page_view(self.segment.array())

    def page(self, page_id: int) -> np.ndarray:
        """Page `page_id` as a `[num_layers, 2, segment_bytes]` view."""
        return self.pages[page_id]

    def register(self, client: Client, namespace: Namespace) -> PoolHandle:
        """Register this pool with the daemon over `client`, by its segment's name.

        Raises:
            ProtocolError: the namespace's pages are not this pool's size.
            DaemonReplyError: the daemon refused the pool.
        """
        _check_page_bytes(namespace, self.layout)
        return client.register_pool(namespace, self.segment.name, self.layout)

    def close(self) -> None:
        """Unmap and unlink the segment (idempotent)."""
        self.pages = np.empty(0, np.uint8)
        self.segment.close()
        self.segment.unlink()

    def __enter__(self) -> SegmentPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
