"""The client's pool in shared memory: an engine's pages where the daemon can copy them.

On a machine without a GPU (and in tests and CI) an engine keeps its KV pages in a new
shared-memory segment laid out as its `PoolLayout`; the daemon opens that segment by name and
copies with system calls on its descriptor (`kvtier.transfer.pool_file`). Verbs: `SharedPool`,
`SharedPool.page`, `SharedPool.register`, `SharedPool.close`.
"""

from __future__ import annotations

import numpy as np

from kvtier.client.connection import Client
from kvtier.client.results import PoolHandle
from kvtier.errors import ProtocolError
from kvtier.keys import Namespace
from kvtier.pool_layout import PoolLayout
from kvtier.shm import SharedSegment, new_segment_name


class SharedPool:
    """An engine page pool in a new shared-memory segment (the CPU stand-in for device memory).

    `pages` is the `[num_pages, num_layers, 2, segment_bytes]` view the daemon also uses;
    `register(client, namespace)` hands it to the daemon. Close it to unlink the segment.
    """

    def __init__(self, layout: PoolLayout) -> None:
        layout.validate(layout.span_bytes)
        self.layout = layout
        self.segment = SharedSegment.create(new_segment_name("kvtier-pool"), layout.span_bytes)
        self.segment.prefault()
        self.pages = layout.page_view(self.segment.array())

    def page(self, page_id: int) -> np.ndarray:
        """Page `page_id` as a `[num_layers, 2, segment_bytes]` view."""
        return self.pages[page_id]

    def register(self, client: Client, namespace: Namespace) -> PoolHandle:
        """Register this pool with the daemon over `client`.

        Raises:
            ProtocolError: the namespace's pages are not this pool's size.
            DaemonReplyError: the daemon refused the pool.
        """
        if namespace.page_bytes != self.layout.page_bytes:
            raise ProtocolError(f"namespace pages are {namespace.page_bytes} bytes, this pool's "
                                f"are {self.layout.page_bytes}")
        return client.register_pool(namespace, self.segment.name, self.layout)

    def close(self) -> None:
        """Unmap and unlink the segment (idempotent)."""
        self.pages = np.empty(0, np.uint8)
        self.segment.close()
        self.segment.unlink()

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
