"""`KvtierConnector`: vLLM's KV connector interface, answered by the scheduler and worker halves.

vLLM makes one connector per role: in its engine-core process for the scheduler, and in each
worker process for the model's memory (in one process they are two objects). They share
nothing but the daemon, which is the point: pages one engine stores, every engine on the node
and every later engine process can recall. Settings: `kvtier.integrations.vllm.options`.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.integrations.vllm.geometry import page_geometry
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.integrations.vllm.plans import KvtierMetadata
from kvtier.integrations.vllm.recall_stats import KvtierRecallStats
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide

# A child of vLLM's logger: the connector's lines show in the engine's log, in its format.
log = logging.getLogger("vllm.kvtier." + __name__.rsplit(".", 1)[-1])


class KvtierConnector(KVConnectorBase_V1):
    """Shares KV pages between vLLM engines through the node's kvtier daemon.

    Load it with `kv_transfer_config={"kv_connector": "KvtierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
    "kv_connector_extra_config": {...}}` (see `ConnectorOptions`).

    Raises:
        ConfigError: at engine start, for a bad `kv_connector_extra_config` or a KV cache
            kvtier cannot hold (the message says which and why).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # kvtier is a cache: a page it cannot deliver (evicted since the lookup, corrupt, the
        # daemon gone) is recomputed, never an error for the request. vLLM reads this setting
        # right after making the scheduler's connector.
        self._kv_transfer_config.kv_load_failure_policy = "recompute"
        options = ConnectorOptions.parse(self._kv_transfer_config.kv_connector_extra_config)
        geometry = page_geometry(vllm_config, kv_cache_config, options.model_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(geometry, options)
        else:
            self._worker = WorkerSide(geometry, options)
        log.info("kvtier connector (%s): namespace %s, %d-byte pages", role.name.lower(),
                 geometry.namespace.model_id, geometry.namespace.page_bytes)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a store that never happens is a later miss, not a lost hand-off

    @property
    def supports_sleep_mode(self) -> bool:
        # vLLM 0.33's sleep mode frees the KV cache and maps a new one (unregister_kv_caches /
        # restore_kv_caches): the daemon would still copy into the old pool. Until the
        # connector registers the new memory, an engine with it cannot sleep.
        return False

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        num_tokens = self._scheduler.num_new_matched_tokens(request, num_computed_tokens)
        # Parked (asynchronous): vLLM runs others until get_finished reports its pages landed.
        return num_tokens, num_tokens > 0 and self._scheduler.parks(request)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        if num_external_tokens > 0:
            self._scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_metadata(scheduler_output)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    def update_connector_output(self, connector_output: Any) -> None:
        # The workers' recall times of the last step: the parking rule's bandwidth.
        stats = getattr(connector_output, "kv_connector_stats", None)
        if self._scheduler is not None and isinstance(stats, KvtierRecallStats) and (
                not stats.is_empty()):
            self._scheduler.recalls_timed(stats.data["recall_bytes"],
                                          stats.data["recall_seconds"], stats.data["recalls"])

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvtierRecallStats(data=dict(data or {}))

    # Worker side.

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        return self._worker.allocation_context() if self._worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None and isinstance(kv_connector_metadata, KvtierMetadata)
        self._worker.wait_for_preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvtierMetadata)
        self._worker.start_loads(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # a synchronous recall is whole before the forward; an asynchronous one between steps
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # stores go once per step, in wait_for_save, all layers of a block at once

    def wait_for_save(self) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvtierMetadata)
        self._worker.submit_stores(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        stored, recalled = self._worker.finished(finished_req_ids)
        return stored or None, recalled or None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:  # the scheduler's connector times nothing
            return None
        num_bytes, seconds, count = self._worker.recall_times.take()
        return KvtierRecallStats.of(num_bytes, seconds, count) if count else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
