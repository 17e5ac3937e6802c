"""The backend's figures in SGLang's `StorageMetrics` shape: pages and GB/s per call.

SGLang's scheduler calls `get_stats()` when it logs storage metrics and expects the figures
since the previous call (Mooncake and 3FS do the same). Verbs: `record_prefetch`,
`record_backup`, `take`.
"""

from __future__ import annotations

import threading
from typing import Any


def storage_metrics_class() -> Any:
    """SGLang's StorageMetrics (it moved in 0.5.15)."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:
        from sglang.srt.metrics.collector import StorageMetrics
    return StorageMetrics


class TransferStats:
    """Pages moved and bandwidth of each recall (prefetch) and store (backup) call."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._metrics = storage_metrics_class()()

    def record_prefetch(self, num_pages: int, elapsed_s: float, page_bytes: int) -> None:
        """One `batch_get_v1` that landed `num_pages`."""
        if self.enabled and num_pages:
            with self._lock:
                self._metrics.prefetch_pgs.append(num_pages)
                self._metrics.prefetch_bandwidth.append(_gb_per_s(num_pages, page_bytes, elapsed_s))

    def record_backup(self, num_pages: int, elapsed_s: float, page_bytes: int) -> None:
        """One `batch_set_v1` that kept `num_pages`."""
        if self.enabled and num_pages:
            with self._lock:
                self._metrics.backup_pgs.append(num_pages)
                self._metrics.backup_bandwidth.append(_gb_per_s(num_pages, page_bytes, elapsed_s))

    def take(self) -> Any:
        """The figures since the last `take`, as a `StorageMetrics`."""
        with self._lock:
            metrics, self._metrics = self._metrics, storage_metrics_class()()
        return metrics


def _gb_per_s(num_pages: int, page_bytes: int, elapsed_s: float) -> float:
    return num_pages * page_bytes / max(elapsed_s, 1e-9) / 1e9
