"""The remote tier's connection: one Redis or Valkey client (a server or a cluster), kept answering.

Everything here runs on the remote tier's own event loop (redis-py's asyncio clients), except
`connected`, `wait_connected` and `note_failure`, which any thread may call. When the server stops
answering, the connection marks itself down (one log line), the tier answers every call at once
as a miss or a dropped write, and a probe reconnects in the background with backoff. A cluster
is reconnected from scratch (its slot map may have changed), and the connections of nodes that
left the slot map are closed here, since redis-py does not.

Verbs: `prepare`, `connect_at_start`, `stay_connected`, `note_failure`, `note_cluster_nodes`,
`wait_connected`, `close`, `redact`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvtier.config import RemoteConfig

# The remote tier's one logger name, whichever of its modules logs: operators filter on it
# (docs/remote-tier.md shows its lines).
log = logging.getLogger("kvtier.tiers.remote")

PROBE_MIN_S = 0.25
PROBE_MAX_S = 5.0
HEALTH_PERIOD_S = 1.0
SOCKET_READ_BYTES = 1 << 20


@dataclass(slots=True)
class RemoteCounters:
    """Running counters of the remote tier (the connection counts errors, timeouts and outages;
    the tier the rest)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    pages_written: int = 0
    pages_expired_by_budget: int = 0
    writes_dropped: int = 0  # not sent: disconnected, or the send queue was full
    errors: int = 0
    timeouts: int = 0
    integrity_errors: int = 0
    outages: int = 0  # times the tier went offline (down at start counts once)


def redact(url: str) -> str:
    """`url` without its password, for logs and stats."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


class RemoteConnection:
    """The client of one remote tier and its health.

    Args:
        config: the server URL (several comma-separated URLs, or `cluster = true`, for a
            cluster) and timeouts.
        counters: the tier's counters (errors, timeouts and outages are counted here).
        loop: the tier's event loop, where every request runs.
    """

    def __init__(self, config: RemoteConfig, counters: RemoteCounters,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.url = redact(config.url)
        self.counters = counters
        self.client: Any = None  # redis.asyncio Redis or RedisCluster, once connected
        self.closing = False  # set when the tier closes: failures after that are no outage
        self._up = threading.Event()  # set while the server answers; waitable (`wait_connected`)
        self._urls = [u.strip() for u in config.url.split(",") if u.strip()]
        self._is_cluster = config.cluster or len(self._urls) > 1
        self._down_since: float | None = None
        self._loop = loop

    @property
    def connected(self) -> bool:
        """Whether the server answered the last request or probe."""
        return self._up.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the server answers (the probe reconnects by itself); False on timeout."""
        return self._up.wait(timeout_s)

    def prepare(self) -> None:
        """Make the loop's own state; on the loop, before any other verb but `connected`."""
        self._broken = asyncio.Event()
        self._retired: list = []  # replaced clients, closed again at exit
        self._connecting = asyncio.Lock()  # one connection attempt at a time
        # Cluster nodes seen in use, by identity: redis-py drops a node that leaves the slot map
        # without closing its in-use connections (redis-py #4053), so they are closed here.
        self._cluster_nodes: dict[int, Any] = {}  # redis-py cluster nodes
        # Every connection a cluster client made (`_track_connections`): a node dropped between
        # two looks at the slot map escapes `_cluster_nodes`, and its open connection would
        # warn when collected long after (ResourceWarning); `close` closes them all.
        self._cluster_connections: weakref.WeakSet = weakref.WeakSet()

    async def connect_at_start(self) -> None:
        """Wait briefly for a first answer, so a daemon that starts with a healthy server serves
        remote hits from its first request; an absent server is the probe's job (logged)."""
        try:
            await asyncio.wait_for(self._reconnect(), self.config.timeout_s)
        except Exception as exc:
            self.note_failure("connect", exc, on_loop=True)
            self.counters.outages += 1
            log.warning("remote tier %s unreachable at start (%s); serving local tiers only, "
                        "retrying in the background", self.url, type(exc).__name__)

    async def close(self) -> None:
        """Close the client, every client it replaced and every cluster connection made."""
        await self._close_client()
        # Again: a request in flight when its client was replaced returned its connection to
        # the closed pool afterwards; closing twice releases it.
        for client in self._retired:
            await _close_quietly(client)
        for connection in list(self._cluster_connections):
            if connection.is_connected:
                try:
                    await connection.disconnect()
                except Exception as exc:  # the socket is already gone
                    log.debug("closing a cluster connection: %s", exc)

    def _make_client(self) -> Any:
        from redis.asyncio import Redis
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        urls = self._urls
        common: dict[str, Any] = {"socket_timeout": self.config.timeout_s,
                                  "socket_connect_timeout": self.config.timeout_s,
                                  "socket_read_size": SOCKET_READ_BYTES}
        if self._is_cluster:
            from redis.asyncio.connection import SSLConnection, parse_url

            nodes = [ClusterNode(urlsplit(u).hostname or "localhost", urlsplit(u).port or 6379)
                     for u in urls]
            # Credentials, TLS and its query options (ssl_ca_certs=...) from the first seed.
            seed = parse_url(urls[0])
            options: dict[str, Any] = {k: v for k, v in seed.items()
                                       if k not in ("host", "port", "db", "path",
                                                    "connection_class")}
            ssl = seed.get("connection_class") is SSLConnection
            cluster = RedisCluster(startup_nodes=nodes, ssl=ssl, require_full_coverage=False,
                                   **{**options, **common})
            self._track_connections(cluster)
            return cluster
        return Redis.from_url(urls[0], **common)

    def _track_connections(self, cluster: Any) -> None:
        """Keep (weakly) every connection `cluster`'s nodes make, now and after a slot map
        change: RedisCluster takes no connection class, but every node it creates takes its
        class from the client's `connection_kwargs`, and the seeds exist already."""
        tracked = _tracked_in(cluster.connection_kwargs["connection_class"],
                              self._cluster_connections)
        cluster.connection_kwargs["connection_class"] = tracked
        for node in cluster.startup_nodes:
            node.connection_class = tracked

    async def _reconnect(self) -> None:
        """Connect (or check the connection) unless connected; one attempt at a time."""
        async with self._connecting:
            if self.connected:
                return  # the other attempt won while this one waited
            if self._is_cluster:
                await self._close_client()  # a cluster may have a new slot map: start over
            await self._connect_once()

    async def _connect_once(self) -> None:
        if self.client is None:
            client = self._make_client()
            try:
                if hasattr(client, "initialize"):
                    await client.initialize()  # a cluster learns its slot map
                await client.ping()
            except BaseException:
                self._retired.append(client)
                await _close_quietly(client)
                raise
            self.client = client
        else:
            await self.client.ping()
        if not self._up.is_set():
            # Log, then set: whoever `wait_connected` wakes finds the line already written.
            if self._down_since is None:
                log.info("remote tier %s connected", self.url)
            else:
                log.warning("remote tier %s reconnected after %.1f s", self.url,
                            time.monotonic() - self._down_since)
            self._up.set()
            self._broken.clear()
            self._down_since = None

    async def _close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            self.note_cluster_nodes(client)  # their connections are closed again at exit
            self._retired.append(client)
            await _close_quietly(client)

    async def stay_connected(self) -> None:
        """Probe while disconnected (with backoff), check health while connected."""
        delay = PROBE_MIN_S
        while True:
            if self.connected:
                try:
                    await asyncio.wait_for(self._broken.wait(), HEALTH_PERIOD_S)
                except TimeoutError:
                    try:
                        client = self.client
                        assert client is not None  # connected: a client is set
                        await asyncio.wait_for(client.ping(), self.config.timeout_s)
                    except Exception as exc:
                        self.note_failure("health check", exc, on_loop=True)
                    if self._is_cluster:
                        await self._reap_cluster_nodes()
                delay = PROBE_MIN_S
                continue
            await asyncio.sleep(delay)  # the probe's pace, not a synchronization
            try:
                await asyncio.wait_for(self._reconnect(), self.config.timeout_s)
            except Exception:
                delay = min(delay * 2, PROBE_MAX_S)

    def note_cluster_nodes(self, client: Any) -> None:
        """Remember the nodes `client` uses now, to close their connections once they leave."""
        if self._is_cluster:
            for node in client.get_nodes():
                self._cluster_nodes.setdefault(id(node), node)

    async def _reap_cluster_nodes(self) -> None:
        """Close the connections of cluster nodes no longer in the slot map."""
        client = self.client
        live: set[int] = set() if client is None else {id(n) for n in client.get_nodes()}
        for key in [k for k in self._cluster_nodes if k not in live]:
            node = self._cluster_nodes.pop(key)
            try:
                await node.disconnect()
            except Exception as exc:  # already closed
                log.debug("closing a departed cluster node: %s", exc)

    def note_failure(self, action: str, exc: BaseException, on_loop: bool = False) -> None:
        """Count a failed `action`; unless closing, mark the connection down (logged once) and
        wake the probe. `on_loop`: called on the tier's loop, not from another thread."""
        if isinstance(exc, TimeoutError | asyncio.TimeoutError):
            self.counters.timeouts += 1
        else:
            self.counters.errors += 1
        if self.closing:
            return
        if self._down_since is None:
            self._down_since = time.monotonic()
        if self._up.is_set():
            self._up.clear()
            self.counters.outages += 1
            log.warning("remote tier %s unreachable (%s failed: %s); serving local tiers only "
                        "until it answers again", self.url, action,
                        f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if on_loop:
            self._broken.set()
        else:
            self._loop.call_soon_threadsafe(self._broken.set)


def _tracked_in(connection_class: type, connections: weakref.WeakSet) -> type:
    """A subclass of redis-py's `connection_class` whose every instance joins `connections`."""

    class TrackedConnection(connection_class):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            connections.add(self)

    return TrackedConnection


async def _close_quietly(client: Any) -> None:
    try:
        await client.aclose()
    except Exception as exc:  # the connection is already gone
        log.debug("closing a remote client: %s", exc)
