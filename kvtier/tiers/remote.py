"""The remote tier: pages in Redis or Valkey (one server or a cluster), shared by every node.

A page is stored as one value: the disk tier's 64-byte header (magic, version, namespace, key,
length, xxh3 checksum) followed by the payload, under `<prefix>:<fingerprint hex>:<key hex>`, so
pages of different models never meet and every value read back is verified before it is served:
one that fails is a miss plus a logged integrity error, and is deleted from the server.

All Redis I/O runs on this tier's own thread and event loop (redis-py's asyncio clients): callers
on the daemon's copy threads wait for a fetch with a timeout, and writes are queued and sent in
pipelined batches, so a slow or absent server never stalls a local hit. When the server stops
answering, the tier marks itself disconnected (one log line), every call returns at once as a miss
or a dropped write, and a probe reconnects it in the background.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from kvtier.config import RemoteConfig
from kvtier.tiers.page_format import HEADER, HEADER_BYTES, pack_header, payload_checksum, verify_page

log = logging.getLogger(__name__)

WRITE_BATCH_PAGES = 64
WRITE_BATCH_BYTES = 64 << 20
PROBE_MIN_S = 0.25
PROBE_MAX_S = 5.0
HEALTH_PERIOD_S = 1.0
STOP_TIMEOUT_S = 30.0  # close(): closing the connections, and the loop thread's exit
MIN_LINK_BYTES_PER_S = 100e6  # a fetch's deadline grows with its size at this pace
LATENCY_WINDOW = 1024
# A fetch is split into MGETs of about this many bytes (a single page is a GET), two in flight
# on two connections while the caller verifies and copies the chunks already in. Measured on
# loopback (bench/bench_remote.py, 2 MiB pages, quiet 2-core machine): one request in flight at a
# time left the server idle while the client parsed (0.73-0.82 of a raw GET loop); two in flight
# 0.88-1.0; one MGET of everything, or many in flight, read 1.3-2x slower than either.
FETCH_CHUNK_BYTES = 4 << 20
FETCH_CONCURRENCY = 2
SOCKET_READ_BYTES = 1 << 20


@dataclass(slots=True)
class RemoteCounters:
    """Running counters of the remote tier."""

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


def redis_key(key_prefix: str, scoped_key: bytes) -> str:
    """The Redis key of a page: prefix, namespace fingerprint, key."""
    return f"{key_prefix}:{scoped_key[:16].hex()}:{scoped_key[16:].hex()}"


def frame_page(scoped_key: bytes, payload: np.ndarray | memoryview | bytes,
               checksum: int | None = None) -> bytes:
    """The value stored for a page: header then payload (one copy of the payload)."""
    # numpy's stubs do not declare the buffer protocol an ndarray implements.
    view = memoryview(payload).cast("B")  # type: ignore[arg-type]
    if checksum is None:
        checksum = payload_checksum(view)
    return pack_header(scoped_key, len(view), checksum) + view


def unframe_page(value: bytes, scoped_key: bytes, payload_bytes: int) -> tuple[memoryview | None,
                                                                                  str | None]:
    """The verified payload of a stored value, or None and what is wrong with it."""
    if len(value) != HEADER_BYTES + payload_bytes:
        return None, f"value of {len(value)} bytes for a {payload_bytes}-byte page"
    checksum = HEADER.unpack_from(value)[-1]
    problem = verify_page(memoryview(value), scoped_key, payload_bytes, checksum)
    if problem is not None:
        return None, problem
    return memoryview(value)[HEADER_BYTES:], None


class RemoteTier:
    """A Redis / Valkey server or cluster as the tier below disk.

    Thread-safe. `fetch` blocks its caller for at most the configured timeout; `put` never blocks.

    Args:
        config: the server URL (several comma-separated URLs, or `cluster = true`, for a
            cluster), timeouts, TTL and this node's byte budget.
    """

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.url = redact(config.url)
        self.counters = RemoteCounters()
        self._client: Any = None  # redis.asyncio Redis or RedisCluster, once connected
        self._up = threading.Event()  # set while the server answers; waitable (`wait_connected`)
        self._closing = False
        self._urls = [u.strip() for u in config.url.split(",") if u.strip()]
        self._is_cluster = config.cluster or len(self._urls) > 1
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._latencies_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
        # Keys this node wrote, oldest first, with their size and expiry: the byte budget.
        self._written: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._written_bytes = 0
        self._loop = _new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-remote",
                                        daemon=True)
        self._thread.start()
        self._started = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self._started.result()

    # -- public verbs (any thread) ------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the server answered the last request or probe."""
        return self._up.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the server answers (the probe reconnects by itself); False on timeout."""
        return self._up.wait(timeout_s)

    def name_of(self, scoped_key: bytes) -> str:
        """The Redis key of a page (`redis_key` with this tier's prefix)."""
        return redis_key(self.config.key_prefix, scoped_key)

    def fetch(self, scoped_keys: Sequence[bytes], payload_bytes: int) -> list[memoryview | None]:
        """The verified payloads of `scoped_keys` (None for a miss); see `fetch_chunks`."""
        payloads: list[memoryview | None] = []
        for _, chunk in self.fetch_chunks(scoped_keys, payload_bytes):
            payloads += chunk
        return payloads

    def fetch_chunks(self, scoped_keys: Sequence[bytes], payload_bytes: int
                     ) -> Generator[tuple[int, list[memoryview | None]], None, None]:
        """Yield (first index, verified payloads or None) chunk by chunk, in key order.

        A request up to `FETCH_CHUNK_BYTES` is one MGET; a larger one is split into MGETs, up
        to `FETCH_CONCURRENCY` in flight on separate connections, each verified on the tier's
        loop as it lands, so the caller copies one chunk while the next is on the wire.
        Disconnected: all misses at once. A timeout or error makes the rest misses and marks the
        tier disconnected until the probe gets an answer. Closing the iterator early cancels
        what is still in flight.
        """
        if not scoped_keys:
            return
        if not self.connected:
            self.counters.misses += len(scoped_keys)
            yield 0, [None] * len(scoped_keys)
            return
        names = [self.name_of(k) for k in scoped_keys]
        per_chunk = max(1, FETCH_CHUNK_BYTES // (payload_bytes + HEADER_BYTES))
        deadline_s = self.config.timeout_s + len(names) * payload_bytes / MIN_LINK_BYTES_PER_S
        started = time.perf_counter()
        futures = [asyncio.run_coroutine_threadsafe(
            self._mget_verified(scoped_keys[i : i + per_chunk], names[i : i + per_chunk],
                                payload_bytes, deadline_s), self._loop)
            for i in range(0, len(names), per_chunk)]
        try:
            for number, future in enumerate(futures):
                first = number * per_chunk
                try:
                    payloads = future.result(deadline_s + 1.0)
                except Exception as exc:  # timeouts, connection errors, cluster errors: misses
                    self._note_failure("fetch", exc)
                    self.counters.misses += len(scoped_keys) - first
                    yield first, [None] * (len(scoped_keys) - first)
                    return
                if number == 0:
                    self._latencies_ms.append((time.perf_counter() - started) * 1e3)
                yield first, payloads
        finally:
            for future in futures:
                future.cancel()

    def _verify(self, scoped_keys: Sequence[bytes], names: list[str],
                values: list[bytes | None], payload_bytes: int) -> list[memoryview | None]:
        payloads: list[memoryview | None] = []
        corrupt = []
        for scoped_key, name, value in zip(scoped_keys, names, values):
            if value is None:
                self.counters.misses += 1
                payloads.append(None)
                continue
            payload, problem = unframe_page(value, scoped_key, payload_bytes)
            if problem is not None:
                self.counters.misses += 1
                self.counters.integrity_errors += 1
                log.error("integrity error: remote page %s not served: %s", name, problem)
                corrupt.append(name)
            else:
                self.counters.hits += 1
                self.counters.bytes_read += payload_bytes
            payloads.append(payload)
        if corrupt:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ("del", corrupt, 0))
        return payloads

    def put(self, scoped_key: bytes, value: bytes) -> bool:
        """Queue one framed page (`frame_page`) for writing; False when it was dropped."""
        if not self.connected or self._closing:
            self.counters.writes_dropped += 1
            return False
        with self._lock:
            if self._pending_bytes + len(value) > self.config.max_pending_bytes:
                self.counters.writes_dropped += 1
                return False
            self._pending_bytes += len(value)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, ("set", scoped_key, value))
        return True

    def accepts_writes(self) -> bool:
        """Whether a `put` now would be queued (connected, room in the send queue)."""
        return self.connected and not self._closing and (
            self._pending_bytes < self.config.max_pending_bytes)

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write was sent (or failed); False on timeout."""
        future = asyncio.run_coroutine_threadsafe(self._queue.join(), self._loop)
        try:
            future.result(timeout_s)
            return True
        except TimeoutError:
            future.cancel()
            return False

    def stats(self) -> dict:
        """Counters, connection state, budget and round-trip latency, as plain data."""
        latencies = np.array(list(self._latencies_ms), dtype=np.float64)
        p50, p99 = ((float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99)))
                    if len(latencies) else (0.0, 0.0))
        total = self.counters.hits + self.counters.misses
        return {"tier": "remote", "url": self.url, "connected": self.connected,
                **asdict(self.counters), "hit_ratio": self.counters.hits / total if total else 0.0,
                "budget_bytes": self.config.budget_bytes, "written_bytes": self._written_bytes,
                "pending_bytes": self._pending_bytes, "p50_ms": p50, "p99_ms": p99}

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Send what is queued (up to `drain_timeout_s`), then close the connections."""
        if self._closing:
            return
        if self.connected and not self.drain(drain_timeout_s):
            log.warning("remote tier: %d bytes of queued writes not sent at exit",
                        self._pending_bytes)
        self._closing = True
        future = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        stopped = False
        try:
            # Its own bound, not the drain's: on a busy machine closing the connections may
            # take seconds, and a stop cut short leaves transports half closed (below).
            future.result(STOP_TIMEOUT_S)
            stopped = True
        except Exception as exc:  # closing a broken connection may fail; nothing is lost
            log.debug("remote tier close: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT_S)
        # uvloop's close() runs the loop until every handle has closed: after a stop cut short
        # one may never close, and close() blocked for ever (seen under load). Such a loop is
        # left to the process's exit instead.
        if stopped and not self._thread.is_alive():
            self._loop.close()

    # -- the tier's own event loop ----------------------------------------------------------

    async def _start(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._broken = asyncio.Event()
        self._fetch_slots = asyncio.Semaphore(FETCH_CONCURRENCY)
        self._retired: list = []  # replaced clients, closed again at exit
        self._connecting = asyncio.Lock()  # one connection attempt at a time
        # Cluster nodes seen in use, by identity: redis-py drops a node that leaves the slot map
        # without closing its in-use connections (redis-py #4053), so they are closed here.
        self._cluster_nodes: dict[int, Any] = {}  # redis-py cluster nodes
        self._tasks = [asyncio.create_task(self._write_forever()),
                       asyncio.create_task(self._stay_connected())]
        # Wait briefly for a first answer so a daemon that starts with a healthy server serves
        # remote hits from its first request; an absent server is the probe's job.
        try:
            await asyncio.wait_for(self._reconnect(), self.config.timeout_s)
        except Exception as exc:
            self._note_failure("connect", exc, on_loop=True)
            self.counters.outages += 1
            log.warning("remote tier %s unreachable at start (%s); serving local tiers only, "
                        "retrying in the background", self.url, type(exc).__name__)

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close_client()
        # Again: a request in flight when its client was replaced returned its connection to
        # the closed pool afterwards; closing twice releases it.
        for client in self._retired:
            await _close_quietly(client)
        await self._reap_cluster_nodes(everything=True)

    def _make_client(self):
        from redis.asyncio import Redis
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        urls = self._urls
        common = {"socket_timeout": self.config.timeout_s,
                  "socket_connect_timeout": self.config.timeout_s,
                  "socket_read_size": SOCKET_READ_BYTES}
        if self._is_cluster:
            from redis.asyncio.connection import SSLConnection, parse_url

            nodes = [ClusterNode(urlsplit(u).hostname or "localhost", urlsplit(u).port or 6379)
                     for u in urls]
            # Credentials, TLS and its query options (ssl_ca_certs=...) from the first seed.
            seed = parse_url(urls[0])
            options = {k: v for k, v in seed.items()
                       if k not in ("host", "port", "db", "path", "connection_class")}
            ssl = seed.get("connection_class") is SSLConnection
            return RedisCluster(startup_nodes=nodes, ssl=ssl, require_full_coverage=False,
                                **{**options, **common})
        return Redis.from_url(urls[0], **common)

    async def _reconnect(self) -> None:
        """Connect (or check the connection) unless connected; one attempt at a time."""
        async with self._connecting:
            if self.connected:
                return  # the other attempt won while this one waited
            if self._is_cluster:
                await self._close_client()  # a cluster may have a new slot map: start over
            await self._connect_once()

    async def _connect_once(self) -> None:
        if self._client is None:
            client = self._make_client()
            try:
                if hasattr(client, "initialize"):
                    await client.initialize()  # a cluster learns its slot map
                await client.ping()
            except BaseException:
                self._retired.append(client)
                await _close_quietly(client)
                raise
            self._client = client
        else:
            await self._client.ping()
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
        client, self._client = self._client, None
        if client is not None:
            self._note_cluster_nodes(client)  # their connections are closed again at exit
            self._retired.append(client)
            await _close_quietly(client)

    async def _stay_connected(self) -> None:
        """Probe while disconnected (with backoff), check health while connected."""
        delay = PROBE_MIN_S
        while True:
            if self.connected:
                try:
                    await asyncio.wait_for(self._broken.wait(), HEALTH_PERIOD_S)
                except TimeoutError:
                    try:
                        client = self._client
                        assert client is not None  # connected: a client is set
                        await asyncio.wait_for(client.ping(), self.config.timeout_s)
                    except Exception as exc:
                        self._note_failure("health check", exc, on_loop=True)
                    if self._is_cluster:
                        await self._reap_cluster_nodes()
                delay = PROBE_MIN_S
                continue
            await asyncio.sleep(delay)  # the probe's pace, not a synchronization
            try:
                await asyncio.wait_for(self._reconnect(), self.config.timeout_s)
            except Exception:
                delay = min(delay * 2, PROBE_MAX_S)

    def _note_cluster_nodes(self, client) -> None:
        if self._is_cluster:
            for node in client.get_nodes():
                self._cluster_nodes.setdefault(id(node), node)

    async def _reap_cluster_nodes(self, everything: bool = False) -> None:
        """Close the connections of cluster nodes no longer in the slot map (all at exit)."""
        client = self._client
        live: set[int] = set() if everything or client is None else {id(n) for n in client.get_nodes()}
        for key in [k for k in self._cluster_nodes if k not in live]:
            node = self._cluster_nodes.pop(key)
            try:
                await node.disconnect()
            except Exception as exc:  # already closed
                log.debug("closing a departed cluster node: %s", exc)

    async def _mget_verified(self, scoped_keys: Sequence[bytes], names: list[str],
                             payload_bytes: int, deadline_s: float) -> list[memoryview | None]:
        # Verified here, on the loop, while the other request in flight streams in: the
        # caller's thread is left only the copy into its pages.
        return self._verify(scoped_keys, names, await self._mget(names, deadline_s),
                            payload_bytes)

    async def _mget(self, names: list[str], deadline_s: float) -> list[bytes | None]:
        client = self._client
        if client is None:
            raise ConnectionError("not connected")
        self._note_cluster_nodes(client)
        async with self._fetch_slots, asyncio.timeout(deadline_s):
            if len(names) == 1:
                return [await client.get(names[0])]
            if hasattr(client, "mget_nonatomic"):
                return await client.mget_nonatomic(names)
            return await client.mget(names)

    async def _write_forever(self) -> None:
        while True:
            first = await self._queue.get()
            batch = [first]
            batch_bytes = len(first[2]) if first[0] == "set" else 0
            while (len(batch) < WRITE_BATCH_PAGES and batch_bytes < WRITE_BATCH_BYTES
                   and not self._queue.empty()):
                item = self._queue.get_nowait()
                batch.append(item)
                batch_bytes += len(item[2]) if item[0] == "set" else 0
            try:
                await self._write_batch(batch)
            except Exception as exc:
                dropped = sum(item[0] == "set" for item in batch)
                self.counters.writes_dropped += dropped
                self._note_failure("write", exc, on_loop=True)
            finally:
                with self._lock:
                    self._pending_bytes -= batch_bytes
                for _ in batch:
                    self._queue.task_done()

    async def _write_batch(self, batch: list[tuple]) -> None:
        client = self._client
        if client is None or not self.connected:
            raise ConnectionError("not connected")
        self._note_cluster_nodes(client)
        ttl_s = self.config.ttl_s or None
        now = time.monotonic()
        started = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        sent: list[tuple[bytes, int]] = []
        for item in batch:
            if item[0] == "del":
                for name in item[1]:
                    pipe.delete(name)
                continue
            _, scoped_key, value = item
            pipe.set(self.name_of(scoped_key), value, ex=ttl_s)
            sent.append((scoped_key, len(value)))
        for old_key in self._over_budget(sent, now):
            pipe.delete(self.name_of(old_key))
        async with asyncio.timeout(self.config.timeout_s + len(batch) * 2 * (1 << 20)
                                   / MIN_LINK_BYTES_PER_S):
            await pipe.execute()
        self._latencies_ms.append((time.perf_counter() - started) * 1e3)
        expires = now + ttl_s if ttl_s else float("inf")
        for scoped_key, num_bytes in sent:
            self._remember_written(scoped_key, num_bytes, expires)
            self.counters.pages_written += 1
            self.counters.bytes_written += num_bytes

    def _over_budget(self, incoming: list[tuple[bytes, int]], now: float) -> list[bytes]:
        """This node's oldest writes to delete so the batch fits its byte budget."""
        while self._written and next(iter(self._written.values()))[1] <= now:
            _, (num_bytes, _) = self._written.popitem(last=False)  # expired on the server
            self._written_bytes -= num_bytes
        budget = self.config.budget_bytes
        if not budget:
            return []
        incoming_bytes = sum(n for k, n in incoming if k not in self._written)
        evicted = []
        while self._written and self._written_bytes + incoming_bytes > budget:
            old_key, (num_bytes, _) = self._written.popitem(last=False)
            self._written_bytes -= num_bytes
            evicted.append(old_key)
        self.counters.pages_expired_by_budget += len(evicted)
        return evicted

    def _remember_written(self, scoped_key: bytes, num_bytes: int, expires: float) -> None:
        previous = self._written.pop(scoped_key, None)
        if previous is not None:
            self._written_bytes -= previous[0]
        self._written[scoped_key] = (num_bytes, expires)
        self._written_bytes += num_bytes

    def _note_failure(self, action: str, exc: BaseException, on_loop: bool = False) -> None:
        if isinstance(exc, TimeoutError | asyncio.TimeoutError):
            self.counters.timeouts += 1
        else:
            self.counters.errors += 1
        if self._closing:
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


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (as the daemon's own loop): its socket reads cost a third of the
    standard loop's, which matters for replies of megabytes read in 1 MiB pieces."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _close_quietly(client) -> None:
    try:
        await client.aclose()
    except Exception as exc:  # the connection is already gone
        log.debug("closing a remote client: %s", exc)
