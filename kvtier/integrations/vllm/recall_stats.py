"""The workers' recalls as vLLM connector stats: what the scheduler's parking rule learns from
(`kvtier.integrations.vllm.parking`), and what vLLM's log shows as "KV Transfer metrics".

vLLM collects a worker's stats after every step, sums them over the workers
(`aggregate`), hands them to the scheduler's connector (`update_connector_output`) and, with
stats logging on, to its logger (`reduce`)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_SUMMED = ("recall_bytes", "recall_seconds", "recalls")


@dataclass
class KvtierRecallStats(KVConnectorStats):
    """Recalls that landed whole: their bytes, their seconds from send to landing, their count."""

    @classmethod
    def of(cls, num_bytes: int, seconds: float, count: int) -> KvtierRecallStats:
        return cls(data={"recall_bytes": num_bytes, "recall_seconds": seconds, "recalls": count})

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in _SUMMED:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = float(self.data.get("recall_seconds", 0.0))
        num_bytes = float(self.data.get("recall_bytes", 0))
        return {"kvtier_recalls": int(self.data.get("recalls", 0)),
                "kvtier_recall_gib": round(num_bytes / 2**30, 3),
                "kvtier_recall_gbps": round(num_bytes / seconds / 1e9, 3) if seconds else 0.0}

    def is_empty(self) -> bool:
        return not self.data.get("recalls")
