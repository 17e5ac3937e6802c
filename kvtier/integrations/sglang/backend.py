"""`KvtierHiCacheStorage`: the node's kvtier daemon as SGLang HiCache's L3 storage.

SGLang's controller threads call the zero-copy v1 interface: `batch_exists` (the leading run of
keys the node holds: one lookup), `batch_set_v1` (a store of host pages) and `batch_get_v1` (a
recall into host pages). The host pool is registered with the daemon as this engine's pool (its
memory is a sealed memfd, see `plugin`), so the daemon copies straight between its tiers and
SGLang's host pages: no copy in SGLang, no page bytes on the socket.

Never raise on the data path: an exception there kills SGLang's controller threads. A failure is
a miss (or a failed backup), logged once per kind; with no daemon every call is a miss at once,
and the link reconnects when one is back (`DaemonLink`, which registers the pool again). Setup
errors (a layout kvtier cannot describe, a host pool outside kvtier's sealed memory) raise at
attach, which SGLang reports and rolls back.
Verbs: SGLang's `HiCacheStorage` (`register_mem_pool_host`, `batch_exists`, `batch_get_v1`,
`batch_set_v1`, `get_stats`, `close`, and the generic-path methods, which miss).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvtier.client import Client, DaemonReplyError, PoolHandle
from kvtier.errors import ConfigError
from kvtier.integrations.sglang.geometry import (
    check_layout,
    host_layout,
    page_key,
    storage_namespace,
)
from kvtier.integrations.sglang.options import BackendOptions
from kvtier.integrations.sglang.plugin import HostMemory, host_memory
from kvtier.integrations.sglang.stats import TransferStats
from kvtier.integrations.vllm.link import CONNECTION_ERRORS, DaemonLink
from kvtier.keys import Namespace
from kvtier.pools.layout import PoolLayout

log = logging.getLogger("sglang.kvtier." + __name__.rsplit(".", 1)[-1])
T = TypeVar("T")


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang's L3 storage in the node's kvtier daemon (load as a dynamic backend).

    Args:
        storage_config: SGLang's `HiCacheStorageConfig`; its `extra_config` carries the
            options of `BackendOptions` (socket, model_id, timeouts) besides SGLang's own.
        kwargs: what SGLang's factory passes besides (unused).

    Raises:
        ConfigError: `interface_v1` is not set, or an option is malformed.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ConfigError('kvtier\'s SGLang backend moves pages zero-copy only: add '
                              '"interface_v1": 1 to --hicache-storage-backend-extra-config')
        self.options = BackendOptions.from_extra_config(extra)
        self.config = storage_config
        self.model_id = self.options.model_id or storage_config.model_name or ""
        if not self.model_id:
            raise ConfigError("kvtier's SGLang backend needs the model's name to keep its pages "
                              'apart: SGLang passed none; set "model_id" in the extra config')
        self.stats = TransferStats(enabled=storage_config.enable_storage_metrics)
        self.namespace: Namespace | None = None
        self._memory: HostMemory | None = None
        self._handle: PoolHandle | None = None
        self._page_size = 0
        self._page_bytes = 0
        self._layout: PoolLayout | None = None
        self._logged: set[str] = set()
        self._logged_lock = threading.Lock()
        name = f"sglang-tp{storage_config.tp_rank}-{os.getpid()}"
        self._link = DaemonLink(self.options.socket, name, self._register_pool,
                                self.options.reconnect_s, self.options.timeout_s, log,
                                poll_us=self.options.poll_us)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Describe SGLang's host pool as a kvtier pool and register it with the daemon.

        Raises:
            ConfigError: the pool's layout is not one kvtier supports, or its memory is not in
                a sealed memfd (kvtier's SGLang plugin did not allocate it).
        """
        super().register_mem_pool_host(mem_pool_host)
        if getattr(self.config, "should_split_heads", False):
            raise ConfigError("kvtier's SGLang backend does not support heterogeneous "
                              "tensor parallelism (tp_lcm_size)")
        layout = host_layout(mem_pool_host)
        check_layout(mem_pool_host, layout)
        memory = host_memory(mem_pool_host)
        if memory is None:
            raise ConfigError(
                "SGLang's host pool is not in kvtier's sealed memory, so the daemon cannot "
                "reach it: kvtier's SGLang plugin allocates it when the engine starts with the "
                "kvtier backend configured (entry point 'kvtier' in sglang.srt.plugins; check "
                "SGLANG_PLUGINS, if set, names it); attaching kvtier at run time is not supported")
        self._memory, self._page_size = memory, mem_pool_host.page_size
        self.namespace = storage_namespace(self.config, mem_pool_host, layout, self.model_id)
        self._layout, self._page_bytes = layout, layout.page_bytes
        self._link.client()  # connect now if the daemon is up; later otherwise

    def _register_pool(self, client: Client) -> None:
        if self._memory is None or self.namespace is None or self._layout is None:
            raise ConfigError("no host pool registered yet")
        memory = self._memory
        self._handle = client.register_sealed_pool(self.namespace, memory.fd, self._layout,
                                                   memory.name)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, the node holds (0 on any failure)."""
        reply = self._call("lookup", lambda c: c.lookup(self._pool(), [page_key(k) for k in keys]))
        return 0 if reply is None else reply.num_prefix

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Recall the pages of `keys` into host pages at `host_indices` (token slots); per key,
        whether it landed. SGLang counts the leading run of True."""
        started = time.perf_counter()
        done = self._transfer("recall", keys, host_indices)
        self.stats.record_prefetch(sum(done), time.perf_counter() - started,
                                   self._page_bytes)
        return done

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store host pages at `host_indices` under `keys`; per key, whether it is kept."""
        started = time.perf_counter()
        done = self._transfer("store", keys, host_indices)
        self.stats.record_backup(sum(done), time.perf_counter() - started,
                                 self._page_bytes)
        return done

    def _transfer(self, verb: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        page_ids = self._page_ids(host_indices, len(keys))
        if page_ids is None:
            return [False] * len(keys)
        kv_keys = [page_key(k) for k in keys]

        def send(client: Client) -> Any:
            method = client.recall if verb == "recall" else client.store
            return method(self._pool(), kv_keys, page_ids).result()

        result = self._call(verb, send)
        if result is None:
            return [False] * len(keys)
        bad = set(result.failed) | set(result.missing)
        if bad:
            self._log_once(f"{verb}-partial", "kvtier: a %s of %d pages left %d undone (first: "
                           "%s); those are misses", verb, len(keys), len(bad),
                           next(iter(result.failed.values()), "not held"))
        return [key not in bad for key in kv_keys]

    def _page_ids(self, host_indices: torch.Tensor, num_keys: int) -> list[int] | None:
        """The host page of each key: SGLang passes the token slots of whole pages."""
        size = self._page_size
        if size == 0 or host_indices.numel() != num_keys * size:
            self._log_once("indices", "kvtier: %d host slots for %d pages of %d tokens: "
                           "not whole pages; a miss", host_indices.numel(), num_keys, size)
            return None
        starts = host_indices.reshape(num_keys, size)[:, 0].cpu()
        if bool((starts % size).any()):
            self._log_once("aligned", "kvtier: host pages not aligned to %d slots; a miss", size)
            return None
        return (starts // size).tolist()

    def _pool(self) -> PoolHandle:
        if self._handle is None:
            raise ConnectionError("the host pool is not registered with the daemon")
        return self._handle

    def _call(self, verb: str, fn: Callable[[Client], T]) -> T | None:
        """`fn(client)`, or None (logged once per verb and kind) on any failure: SGLang's
        threads must never see an exception from here."""
        try:
            return self._link.call(fn)
        except DaemonReplyError as exc:
            self._log_once(f"{verb}-refused", "kvtier: the daemon refused a %s: %s", verb, exc)
        except CONNECTION_ERRORS:
            pass  # DaemonLink logs the outage once and reconnects
        except Exception:  # noqa: BLE001  a controller thread must live on
            if self._log_once(f"{verb}-error", "kvtier: %s failed; counted as a miss", verb):
                log.exception("kvtier: the %s error", verb)
        return None

    def _log_once(self, kind: str, message: str, *args: object) -> bool:
        with self._logged_lock:
            if kind in self._logged:
                return False
            self._logged.add(kind)
        log.warning(message, *args)
        return True

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` since the last call (pages and GB/s per call)."""
        return self.stats.take()

    def close(self) -> None:
        """Disconnect: the daemon drops this engine's pool; the pages it stored stay."""
        self._link.close()

    def clear(self) -> None:
        """Kept pages are the node's, shared with other engines: a clear leaves them (logged)."""
        self._log_once("clear", "kvtier: clear() leaves the node's pages in place (other "
                       "engines share them); use `kvtier` to drop them")

    # The generic (copying) interface: abstract in SGLang, unused with interface_v1 (required).
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        """Not served (the v1 interface is): a miss."""
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[None]:
        """Not served (the v1 interface is): misses."""
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Not served (the v1 interface is): not kept."""
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Not served (the v1 interface is): not kept."""
        return False

    def exists(self, key: str) -> bool:
        """Whether the node holds `key`."""
        return self.batch_exists([key]) == 1
