"""Counters a store keeps, and the snapshot `PageStore.stats()` returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TierCounters:
    """Running counters of one tier; a lookup that reaches a tier counts one hit or one miss."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


@dataclass(slots=True, frozen=True)
class TierStats:
    """One tier at one moment."""

    tier: str
    capacity_bytes: int
    used_bytes: int
    num_pages: int
    hits: int
    misses: int
    evictions: int
    bytes_written: int
    bytes_read: int

    @property
    def hit_ratio(self) -> float:
        """hits / (hits + misses), 0.0 before the first lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(slots=True)
class StoreCounters:
    """Running counters of the whole store."""

    pages_stored: int = 0
    pages_recalled: int = 0
    bytes_stored: int = 0
    bytes_recalled: int = 0
    promotions: int = 0
    demotions: int = 0
    demotion_failures: int = 0
    integrity_errors: int = 0
    store_failures: int = 0


@dataclass(slots=True, frozen=True)
class StoreStats:
    """A snapshot of the store: per tier figures and store-wide counters."""

    tiers: tuple[TierStats, ...]
    counters: StoreCounters
    num_leases: int
    num_namespaces: int
    remote: dict | None = None  # the remote tier's figures (`RemoteTier.stats`), when there is one

    def tier(self, name: str) -> TierStats:
        """The figures of tier `name` ("host", "disk")."""
        for tier in self.tiers:
            if tier.tier == name:
                return tier
        raise KeyError(name)

    def to_dict(self) -> dict:
        """Plain data for JSON output, hit ratios included."""
        tiers = [{**asdict(t), "hit_ratio": t.hit_ratio} for t in self.tiers]
        return {"tiers": tiers, "counters": asdict(self.counters),
                "num_leases": self.num_leases, "num_namespaces": self.num_namespaces,
                "remote": self.remote}
