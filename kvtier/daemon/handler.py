"""What the control server needs of whatever answers its requests: the `RequestHandler` protocol.

The server (`kvtier.daemon.server`) cuts frames, decodes requests and sends replies; a handler
decides what each request does. The daemon's handler is `kvtier.daemon.service.Service`; the
server depends only on this protocol, so it can be run and tested with any other handler.
`Deferred` is an inline verb's reply that still needs a blocking step off the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvtier.ipc import messages as m

SessionT = TypeVar("SessionT")


@dataclass(slots=True, frozen=True)
class Deferred:
    """An inline verb's reply that needs a remote round trip: `finish()` runs off the loop."""

    finish: Callable[[], m._Reply]


class RequestHandler(Protocol[SessionT]):
    """Answers the requests of client sessions (`SessionT`: whatever the handler keeps per
    connection)."""

    @property
    def executor(self) -> Executor:
        """Where requests that copy pages or touch the disk run."""
        ...

    @property
    def bulk_executor(self) -> Executor:
        """Where frames too large to decode on the loop are decoded (one thread: a client
        sending thousands of keys per request competes with the loop through one thread)."""
        ...

    @property
    def remote_executor(self) -> Executor:
        """Where `Deferred.finish` runs."""
        ...

    @property
    def stats_executor(self) -> Executor:
        """Where `stats_reply` runs."""
        ...

    @property
    def jobs_in_flight(self) -> set[asyncio.Future[Any]]:
        """Requests being answered off the loop: the server adds and discards them."""
        ...

    @property
    def stats_in_flight(self) -> set[asyncio.Future[Any]]:
        """The stats requests among `jobs_in_flight`: the server adds and discards them."""
        ...

    def open_session(self, uid: int, pid: int) -> SessionT:
        """A new client connected (its peer credentials)."""
        ...

    def close_session(self, session: SessionT) -> None:
        """A client left, or died: release what it holds."""
        ...

    def adopt_descriptor(self, session: SessionT, fd: int) -> None:
        """A descriptor arrived on the session's connection (SCM_RIGHTS): the handler owns it
        now, and one unit of the daemon's descriptor budget with it."""
        ...

    def is_inline(self, request: m._Request) -> bool:
        """Whether `request` is answered on the event loop (no copies, no disk I/O)."""
        ...

    def handle(self, session: SessionT, request: m._Request) -> m._Reply | Deferred:
        """The reply to one request other than stats (`stats_reply`); never raises for bad input."""
        ...

    def stats_reply(self, request: m.Stats, received_s: float) -> m._Reply:
        """The reply to a stats request received at monotonic `received_s`."""
        ...
