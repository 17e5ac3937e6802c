"""The connector's worker half: the engine's KV memory as a kvtier pool, recalls and stores.

On a machine without a GPU, vLLM's KV allocation is placed in a sealed memfd
(`allocation_context`, `kvtier.sealed_memory`), whose descriptor the daemon receives and maps as
the engine's pool; on a GPU the allocation is
registered through its CUDA IPC handle. Either way one vLLM block is one kvtier page and no
engine-side copy is made.

A recall is sent before the step's forward. One whose request vLLM parked (`PagePlan.parked`,
asynchronous) is waited for by a thread of its own while vLLM runs other requests; `finished`
reports the request's pages landed and vLLM schedules it on the next step. The others (an idle
engine, or `load_async` off) are waited for before the forward.

Either way a key the daemon could not deliver becomes a block vLLM recomputes
(`load_errors`, reported no later than the request's landing), never garbage in the cache. Stores
are sent after the forward and waited for by a thread of their own, so no forward waits on one; vLLM
keeps a finished request's blocks until `finished` reports its stores done, and a preempted
request's stores end before its blocks are reused (`wait_for_preempted`). A request whose recall
failed stores nothing that step: its new blocks were computed over the missing ones. Each
recall's bytes and time are kept for the scheduler's parking rule (`recall_times`, reported as
vLLM's connector stats).
Verbs: `allocation_context`, `register`, `start_loads`, `submit_stores`, `wait_for_preempted`,
`finished`, `load_errors`, `close`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from kvtier.client import Client, DaemonReplyError, DeviceMemory, Job, PoolHandle
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.geometry import PageGeometry, check_tensors
from kvtier.integrations.vllm.link import CONNECTION_ERRORS, DaemonLink
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.integrations.vllm.parking import RecallTimes
from kvtier.integrations.vllm.plans import KvtierMetadata, PagePlan
from kvtier.sealed_memory import create_sealed, map_sealed
from kvtier.shm import new_segment_name

# A child of vLLM's logger: the connector's lines show in the engine's log, in its format.
log = logging.getLogger("vllm.kvtier." + __name__.rsplit(".", 1)[-1])


class _SharedKvAllocation(TorchFunctionMode):
    """Turns vLLM's one `torch.zeros(size, dtype=int8)` KV allocation on the CPU into a tensor
    over a new sealed memfd (a fresh memfd reads as zeros)."""

    def __init__(self, worker: WorkerSide) -> None:
        super().__init__()
        self._worker = worker

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self._worker.pool_fd < 0 and self._is_kv_buffer(args, kwargs):
            return self._worker.shared_buffer()
        return func(*args, **kwargs)

    def _is_kv_buffer(self, args: Any, kwargs: Any) -> bool:
        size = args[0] if len(args) == 1 else kwargs.get("size")
        device = torch.device(kwargs.get("device") or "cpu")
        return (size == self._worker.geometry.buffer_bytes and kwargs.get("dtype") is torch.int8
                and device.type == "cpu")


class WorkerSide:
    """The pool, the recalls and the stores of one vLLM worker."""

    def __init__(self, geometry: PageGeometry, options: ConnectorOptions) -> None:
        self.geometry = geometry
        self._options = options
        self.pool_name = new_segment_name("kvtier-pool")
        self.pool_fd = -1  # the sealed memfd of the KV allocation on a CPU; -1 until made
        self._pool_array: np.ndarray | None = None
        self._device_memory: DeviceMemory | None = None
        self._on_gpu = False
        self._handle: PoolHandle | None = None
        self._link = DaemonLink(options.socket, f"vllm-worker-{os.getpid()}", self._register_pool,
                                options.reconnect_s, options.timeout_s, poll_us=options.poll_us)
        # Written by the recall thread too: `_loads_changed` guards both sets.
        self._loads_changed = threading.Lock()
        self._load_errors: set[int] = set()
        self._recalled_req_ids: set[str] = set()  # asynchronous recalls landed, not yet reported
        self._failed_load_req_ids: set[str] = set()
        self._recall_jobs: queue.SimpleQueue[tuple[PagePlan, Client, Job, float] | None] = (
            queue.SimpleQueue())
        self.recall_times = RecallTimes()  # what the scheduler's parking rule learns from
        self._recall_waiter = threading.Thread(target=self._wait_for_recalls,
                                               name="kvtier-recalls", daemon=True)
        self._recall_waiter.start()
        # Stores in flight, per request, and the requests vLLM said are finished.
        self._stores_changed = threading.Condition()
        self._num_pending: Counter[str] = Counter()
        self._stored_req_ids: set[str] = set()
        self._finishing: set[str] = set()
        self._store_jobs: queue.SimpleQueue[tuple[str, Client, Job] | None] = queue.SimpleQueue()
        self._waiter = threading.Thread(target=self._wait_for_stores, name="kvtier-stores",
                                        daemon=True)
        self._waiter.start()

    def allocation_context(self) -> contextlib.AbstractContextManager | None:
        """Where vLLM allocates its KV cache: shared memory on a machine without a GPU."""
        if torch.cuda.is_available():
            return None
        return _SharedKvAllocation(self)

    def shared_buffer(self) -> torch.Tensor:
        """The KV allocation in a new sealed memfd the daemon can map."""
        size = self.geometry.buffer_bytes
        self.pool_fd = create_sealed(self.pool_name, size)
        # The tensor holds the array, the array the mapping: it lives as long as vLLM's tensors.
        _, self._pool_array = map_sealed(self.pool_fd, size)
        return torch.from_numpy(self._pool_array).view(torch.int8)

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Check vLLM's KV tensors against the geometry, then register them with the daemon.

        Raises:
            ConfigError: the tensors are not where the geometry says, or (on a CPU) not in the
                shared segment: the connector would copy the wrong bytes.
        """
        base = check_tensors(self.geometry, kv_caches)
        tensor = kv_caches[self.geometry.layer_names[0]]
        if tensor.device.type == "cuda":
            self._on_gpu = True
            self._device_memory = DeviceMemory.wrap(base, self.geometry.buffer_bytes,
                                                    tensor.device.index or 0, owner=tensor)
        elif self._pool_array is None or base != self._pool_array.ctypes.data:
            raise ConfigError("vLLM did not allocate its KV cache through the kvtier connector's "
                              "memory context (get_mem_pool_context): this vLLM is not supported")
        self._link.client()  # connect now if the daemon is up; later otherwise

    def _register_pool(self, client: Client) -> None:
        namespace, layout = self.geometry.namespace, self.geometry.layout
        if self._device_memory is not None:
            self._handle = client.register_device_pool(namespace, self._device_memory, layout)
        elif self.pool_fd >= 0:
            self._handle = client.register_sealed_pool(namespace, self.pool_fd, layout,
                                                       self.pool_name)
        else:
            raise ConfigError("no KV memory registered yet")

    def start_loads(self, metadata: KvtierMetadata) -> None:
        """Recall this step's planned pages into their blocks: asynchronous ones are left to
        land (see `finished`), synchronous ones are waited for here."""
        if not metadata.loads:
            return
        if self._on_gpu:
            torch.cuda.current_stream().synchronize()  # vLLM zeroes new blocks first

        def send(client: Client) -> tuple[Client, list[tuple[PagePlan, Job]]]:
            return client, [(plan, client.recall(self._pool(), plan.keys, plan.block_ids))
                            for plan in metadata.loads]

        sent_at = time.perf_counter()
        sent = self._link.call(send)
        if sent is None:
            for plan in metadata.loads:
                self._land(plan, set(plan.block_ids))
            return
        client, jobs = sent
        waited_bytes = 0
        for plan, job in jobs:
            if plan.parked:
                self._recall_jobs.put((plan, client, job, sent_at))
                continue
            failed = self._failed_blocks(plan, client, job)
            self._land(plan, failed)
            if not failed:
                waited_bytes += len(plan.keys) * self.geometry.namespace.page_bytes
        if waited_bytes:  # the forward waited for these together
            self.recall_times.add(waited_bytes, time.perf_counter() - sent_at)

    def _failed_blocks(self, plan: PagePlan, client: Client, job: Job) -> set[int]:
        """Wait for one recall; the blocks it did not fill."""
        try:
            result = job.result()
        except CONNECTION_ERRORS as exc:
            self._link.lost(client, exc)
            return set(plan.block_ids)
        except DaemonReplyError as exc:
            log.warning("kvtier: recall refused: %s", exc)
            return set(plan.block_ids)
        missing = set(result.failed) | set(result.missing)
        return {block for key, block in zip(plan.keys, plan.block_ids) if key in missing}

    def _land(self, plan: PagePlan, failed_blocks: set[int]) -> None:
        """Record a recall's end: its failed blocks, then (parked) the request as landed."""
        with self._loads_changed:
            self._load_errors |= failed_blocks
            if not plan.parked:
                if failed_blocks:  # its next blocks are computed over the failed ones
                    self._failed_load_req_ids.add(plan.req_id)
                return
            self._recalled_req_ids.add(plan.req_id)

    def _wait_for_recalls(self) -> None:
        while (item := self._recall_jobs.get()) is not None:
            plan, client, job, sent_at = item
            try:
                failed = self._failed_blocks(plan, client, job)
            except Exception:  # this thread must live on: vLLM waits for what it reports
                log.exception("kvtier: recall failed")
                failed = set(plan.block_ids)
            self._land(plan, failed)
            if not failed:
                self.recall_times.add(len(plan.keys) * self.geometry.namespace.page_bytes,
                                      time.perf_counter() - sent_at)

    def _pool(self) -> PoolHandle:
        """The pool's handle on the current connection (registered as it was made)."""
        assert self._handle is not None
        return self._handle

    def load_errors(self) -> set[int]:
        """Blocks whose recall failed since the last call: vLLM recomputes them."""
        with self._loads_changed:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def submit_stores(self, metadata: KvtierMetadata) -> None:
        """Send this step's stores (the forward has written their blocks); do not wait."""
        with self._loads_changed:
            failed, self._failed_load_req_ids = self._failed_load_req_ids, set()
        stores = [plan for plan in metadata.stores if plan.req_id not in failed]
        self._stored_req_ids.update(plan.req_id for plan in metadata.stores)
        if not stores:
            return
        if self._on_gpu:
            torch.cuda.current_stream().synchronize()  # the daemon copies in its own process

        def send(client: Client) -> tuple[Client, list[tuple[PagePlan, Job]]]:
            return client, [(plan, client.store(self._pool(), plan.keys, plan.block_ids,
                                                plan.parent_key)) for plan in stores]

        sent = self._link.call(send)
        if sent is None:  # no daemon: the pages are simply not kept
            return
        client, jobs = sent
        with self._stores_changed:
            for plan, _ in jobs:
                self._num_pending[plan.req_id] += 1
        for plan, job in jobs:
            self._store_jobs.put((plan.req_id, client, job))

    def _wait_for_stores(self) -> None:
        while (item := self._store_jobs.get()) is not None:
            req_id, client, job = item
            try:
                job.result()  # a failed key is a later miss, nothing to undo
            except CONNECTION_ERRORS as exc:
                self._link.lost(client, exc)
            except DaemonReplyError as exc:
                log.warning("kvtier: store refused: %s", exc)
            except Exception:  # this thread must live on: vLLM waits for what it reports
                log.exception("kvtier: store failed")
            with self._stores_changed:
                self._num_pending[req_id] -= 1
                if not self._num_pending[req_id]:
                    del self._num_pending[req_id]
                self._stores_changed.notify_all()

    def wait_for_preempted(self, metadata: KvtierMetadata) -> None:
        """Wait for the stores of requests vLLM preempted: their blocks are about to be reused."""
        with self._stores_changed:
            self._stores_changed.wait_for(
                lambda: not any(self._num_pending[r] for r in metadata.preempted_req_ids
                                if r in self._num_pending))
            # As the scheduler half: vLLM no longer waits on these requests' earlier stores.
            self._stored_req_ids -= metadata.preempted_req_ids

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests vLLM finished whose stores are all done (their blocks may be freed), and
        requests whose asynchronous recall landed since the last call (vLLM may run them)."""
        with self._stores_changed:
            self._finishing.update(finished_req_ids & self._stored_req_ids)
            done = {r for r in self._finishing if r not in self._num_pending}
            self._finishing -= done
            self._stored_req_ids -= done
        with self._loads_changed:
            recalled, self._recalled_req_ids = self._recalled_req_ids, set()
        return done, recalled

    def close(self) -> None:
        """Let the stores in flight end, disconnect, and close the pool's memfd."""
        self._store_jobs.put(None)
        self._recall_jobs.put(None)
        self._waiter.join(self._options.timeout_s)
        self._recall_waiter.join(self._options.timeout_s)
        self._link.close()
        if self.pool_fd >= 0:
            os.close(self.pool_fd)  # the mapping lives on until vLLM drops its tensors
            self.pool_fd = -1
