"""The remote tier: pages in Redis or Valkey (one server or a cluster), shared by every node.

Each page is one value, framed and named as kvtier/tiers/remote_pages.py says; every value read
back is verified before it is served: one that fails is a miss plus a logged integrity error, and
is deleted from the server.

All Redis I/O runs on this tier's own thread and event loop (redis-py's asyncio clients): callers
on the daemon's copy threads wait for a fetch with a timeout, and writes are queued and sent in
pipelined batches by a background sender, which also keeps this node's writes within its byte
budget, so a slow or absent server never stalls a local hit. When the server stops answering, the
tier marks itself disconnected (one log line), every call returns at once as a miss or a dropped
write, and a probe reconnects it in the background (kvtier/tiers/remote_connection.py).

Verbs: `fetch`, `fetch_chunks`, `put`, `accepts_writes`, `drain`, `wait_connected`, `name_of`,
`stats`, `close`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Generator, Sequence
from concurrent.futures import CancelledError
from dataclasses import asdict
from typing import Any

import numpy as np

from kvtier.config import RemoteConfig
from kvtier.tiers.page_format import HEADER_BYTES
from kvtier.tiers.remote_connection import RemoteConnection, RemoteCounters, redact
from kvtier.tiers.remote_pages import frame_page, redis_key, unframe_page

# Importers name these through the remote tier, whichever of its modules defines them.
__all__ = ["RemoteCounters", "RemoteTier", "frame_page", "redact", "redis_key", "unframe_page"]

log = logging.getLogger(__name__)

WRITE_BATCH_PAGES = 64
WRITE_BATCH_BYTES = 64 << 20
STOP_TIMEOUT_S = 30.0  # close(): closing the connections, and the loop thread's exit each
MIN_LINK_BYTES_PER_S = 100e6  # a fetch's deadline grows with its size at this pace
LATENCY_WINDOW = 1024
# A fetch is split into MGETs of about this many bytes (a single page is a GET), two in flight
# on two connections while the caller verifies and copies the chunks already in. Measured on
# loopback (bench/bench_remote.py, 2 MiB pages, quiet 2-core machine): one request in flight at a
# time left the server idle while the client parsed (0.73-0.82 of a raw GET loop); two in flight
# 0.88-1.0; one MGET of everything, or many in flight, read 1.3-2x slower than either.
FETCH_CHUNK_BYTES = 4 << 20
FETCH_CONCURRENCY = 2


class RemoteTier:
    """A Redis / Valkey server or cluster as the tier below disk.

    Thread-safe. `fetch` blocks its caller for at most the configured timeout; `put` never blocks.

    Args:
        config: the server URL (several comma-separated URLs, or `cluster = true`, for a
            cluster), timeouts, TTL and this node's byte budget.
    """

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.counters = RemoteCounters()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._latencies_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
        # Keys this node wrote, oldest first, with their size and expiry: the byte budget.
        self._written: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._written_bytes = 0
        self._loop = _new_event_loop()
        self._connection = RemoteConnection(config, self.counters, self._loop)
        self.url = self._connection.url
        self._thread = threading.Thread(target=self._run_loop, name="kvtier-remote", daemon=True)
        self._thread.start()
        self._started = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self._started.result()

    # -- public verbs (any thread) ------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the server answered the last request or probe."""
        return self._connection.connected

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the server answers (the probe reconnects by itself); False on timeout."""
        return self._connection.wait_connected(timeout_s)

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
                    self._connection.note_failure("fetch", exc)
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
        if not self.connected or self._connection.closing:
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
        return self.connected and not self._connection.closing and (
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
        except CancelledError:  # the tier closed meanwhile
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
        if self._connection.closing:
            return
        if self.connected and not self.drain(drain_timeout_s):
            log.warning("remote tier: %d bytes of queued writes not sent at exit",
                        self._pending_bytes)
        self._connection.closing = True
        future = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        try:
            # Its own bound, not the drain's: on a busy machine closing the connections may
            # take seconds, and a stop cut short leaves transports half closed (_run_loop).
            future.result(STOP_TIMEOUT_S)
        except Exception as exc:  # closing a broken connection may fail; nothing is lost
            log.debug("remote tier close: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            log.error("remote tier: its event loop did not close within %.0f s (a connection that "
                      "never finished closing); leaving it to the process's exit", STOP_TIMEOUT_S)

    # -- the tier's own event loop ----------------------------------------------------------

    @property
    def _client(self) -> Any:
        """The connection's client (None while disconnected): read anew for every request."""
        return self._connection.client

    def _run_loop(self) -> None:
        """The loop thread: run until `close` stops the loop, then close it here, not on the
        caller's thread. uvloop's close() runs the loop until every handle has closed, and a
        transport left half closed kept it waiting for ever (seen under load, with pytest stuck
        and deaf to SIGINT): here such a wait holds only this daemon thread, which `close` joins
        with a deadline."""
        try:
            self._loop.run_forever()
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        """Abort the connections left open (their connection_lost runs in one more turn),
        then close the loop; a failure to close is logged: the loop's sockets go at exit."""
        abort = getattr(self._loop, "abort_open_transports", None)
        if abort is not None and abort():
            log.debug("remote tier: aborted connections its clients left open at close")
            self._loop.run_until_complete(asyncio.sleep(0))
        try:
            self._loop.close()
        except OSError as exc:
            log.error("remote tier: closing its event loop failed (%s); its sockets close at "
                      "the process's exit", exc)

    async def _start(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._fetch_slots = asyncio.Semaphore(FETCH_CONCURRENCY)
        self._connection.prepare()
        # Held here: the loop keeps only weak references to its tasks (`_stop` cancels them
        # with every other task on the loop).
        self._tasks = [asyncio.create_task(self._write_forever()),
                       asyncio.create_task(self._connection.stay_connected())]
        await self._connection.connect_at_start()

    async def _stop(self) -> None:
        # Every task on the loop, the requests in flight (store threads' fetches) too: one that
        # ran on after the close would reopen its client (redis-py re-initializes a closed
        # cluster client on its next command), and the loop would stop with its new
        # connections open, to warn when collected in some later code.
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._connection.close()

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
        self._connection.note_cluster_nodes(client)
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
                self._connection.note_failure("write", exc, on_loop=True)
            finally:
                with self._lock:
                    self._pending_bytes -= batch_bytes
                for _ in batch:
                    self._queue.task_done()

    async def _write_batch(self, batch: list[tuple]) -> None:
        client = self._client
        if client is None or not self.connected:
            raise ConnectionError("not connected")
        self._connection.note_cluster_nodes(client)
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


class _AbortsStrayTransports:
    """A loop mixin that keeps every connection the loop opened, so that its owner can abort
    the ones still open before closing the loop. `RemoteConnection.close` disconnects every
    redis-py connection it made, but a disconnect that times out or fails leaves its socket
    open, and uvloop's close() of a loop still holding a socket warned of it, hung for more
    than 30 s under load, then failed (EBUSY): this is the backstop."""

    _opened: list[asyncio.BaseTransport]

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        transport, protocol = await super().create_connection(  # type: ignore[misc]
            *args, **kwargs)
        # Pruned here: a tier opens a few connections a minute at most.
        self._opened = [t for t in getattr(self, "_opened", []) if not t.is_closing()]
        self._opened.append(transport)
        return transport, protocol

    def abort_open_transports(self) -> int:
        """Abort every connection not yet closing; how many."""
        stray = [t for t in getattr(self, "_opened", []) if not t.is_closing()]
        self._opened = []
        for transport in stray:
            transport.abort()
        return len(stray)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (as the daemon's own loop): its socket reads cost a third of the
    standard loop's, which matters for replies of megabytes read in 1 MiB pieces. Either one
    aborts, at close, the connections nobody closed (`_AbortsStrayTransports`)."""
    try:
        import uvloop
    except ImportError:
        return _SelectorLoop()
    return type("_Uvloop", (_AbortsStrayTransports, uvloop.Loop), {})()


class _SelectorLoop(_AbortsStrayTransports, asyncio.SelectorEventLoop):
    pass
