"""One engine process's connection to the daemon, which may be absent, die or restart.

The engine must keep serving whatever the daemon does: with no daemon it runs without hits and
drops its stores. `DaemonLink.client()` returns a connected `Client`, or None while the daemon
is unreachable; it tries again at most every `reconnect_s`. After each (re)connection `on_connect`
runs on the new client, to register pools or open namespaces again (handles die with their
connection). `call(fn)` runs `fn(client)` and, when the connection turns out dead (a daemon
restarted since the last call), once more on a new one. A connection error met elsewhere is
reported through `lost(client)`, which drops that client. Each outage is logged once per process
(however many links it has), and so is the recovery. Verbs: `client`, `call`, `lost`, `close`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvtier.client import Client
from kvtier.client.polling import DEFAULT_POLL_US
from kvtier.errors import KvtierError

# A child of vLLM's logger: the connector's lines show in the engine's log, in its format.
log = logging.getLogger("vllm.kvtier." + __name__.rsplit(".", 1)[-1])

# What a dead, absent or restarting daemon raises from a call; DaemonReplyError is not among
# them: a refusal is an answer, and the connection stays.
CONNECTION_ERRORS = (ConnectionError, TimeoutError, OSError, EOFError)
T = TypeVar("T")
# Where an outage was logged and not yet recovered, for every link of this process: vLLM runs
# the scheduler's and the workers' connectors in one process, and one line per outage suffices.
_outages_logged: set[str] = set()
_outages_lock = threading.Lock()


class DaemonLink:
    """A `Client` made on demand and remade after the daemon comes back.

    Args:
        socket_path: the daemon's socket ("" for the default).
        client_name: shown by `kvtier stats`.
        on_connect: runs on every new client before it is handed out; an error in it counts as
            the daemon being unreachable.
        reconnect_s: the least time between two connection attempts.
        timeout_s: how long one call may wait for the daemon.
        poll_us: how long the read of a quick reply polls before sleeping (`Client`).
        logger: where outages and recoveries are logged (the engine's log; vLLM's by default).
    """

    def __init__(self, socket_path: str, client_name: str,
                 on_connect: Callable[[Client], None], reconnect_s: float,
                 timeout_s: float, logger: logging.Logger | None = None,
                 poll_us: float = DEFAULT_POLL_US) -> None:
        self._log = logger or log
        self._socket_path = socket_path or None
        self._client_name = client_name
        self._on_connect = on_connect
        self._reconnect_s = reconnect_s
        self._timeout_s = timeout_s
        self._poll_us = poll_us
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._next_attempt_s = 0.0
        self._outage_logged = False
        self._ever_connected = False

    @property
    def where(self) -> str:
        """The socket path, for messages."""
        return str(self._socket_path or "the default kvtier socket")

    def client(self) -> Client | None:
        """The connected client, or None while the daemon cannot be reached."""
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_attempt_s:
                return None
            self._next_attempt_s = now + self._reconnect_s
            try:
                client = Client(self._socket_path, self._client_name, timeout_s=self._timeout_s,
                                poll_us=self._poll_us)
            except CONNECTION_ERRORS as exc:
                self._report_outage(exc)
                return None
            try:
                self._on_connect(client)
            except (*CONNECTION_ERRORS, KvtierError) as exc:
                client.close()
                self._report_outage(exc)
                return None
            with _outages_lock:
                said_outage = self.where in _outages_logged
                _outages_logged.discard(self.where)
            if said_outage or (self._ever_connected and not self._outage_logged):
                self._log.warning("kvtier: connected to the daemon at %s again", self.where)
            elif self._outage_logged or self._ever_connected:
                self._log.info("kvtier: connected to the daemon at %s again", self.where)
            else:
                self._log.info("kvtier: connected to the daemon at %s", self.where)
            self._ever_connected = True
            self._outage_logged = False
            self._client = client
            return client

    def call(self, fn: Callable[[Client], T]) -> T | None:
        """`fn(client)`, or None while the daemon cannot be reached.

        Raises:
            DaemonReplyError: the daemon refused the request (it is there, and answered).
        """
        for _ in range(2):  # a dead connection is found by using it: then one fresh try
            client = self.client()
            if client is None:
                return None
            try:
                return fn(client)
            except CONNECTION_ERRORS as exc:
                self.lost(client, exc)
        return None

    def lost(self, client: Client, error: BaseException) -> None:
        """A call on `client` failed with a connection error: drop it. The next `client()`
        tries a new connection at once (a restarted daemon answers it); if that fails too,
        attempts are spaced by `reconnect_s`."""
        with self._lock:
            if self._client is not client:
                return  # already replaced
            self._client = None
            self._next_attempt_s = 0.0
        client.close()

    def _report_outage(self, error: BaseException) -> None:
        if self._outage_logged:
            return
        self._outage_logged = True
        with _outages_lock:
            if self.where in _outages_logged:
                return  # another link of this process (the scheduler's, a worker's) said it
            _outages_logged.add(self.where)
        # The client's error already says "no kvtier daemon at <path>": name only its cause.
        cause = error.__cause__ if isinstance(error.__cause__, OSError) else error
        reason = getattr(cause, "strerror", None) or str(cause)
        self._log.warning("kvtier: no daemon at %s (%s); serving without kvtier, retrying every %g "
                          "s; start one with `kvtier serve`", self.where, reason, self._reconnect_s)

    def close(self) -> None:
        """Disconnect; the daemon releases this process's pools and leases."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
