"""Placement, planner, cascade and movers built without a `PageStore`, for tests of each alone.

`make_parts(...)` builds the pieces a store holds, metadata-only by default (no arena, a
`DiskLedger` for disk), with tiny tiers in pages of 4 KiB and LRU everywhere. `Parts` offers the
verbs' steps a test drives by hand: `store` (plan, reserve host, commit), `recall_plan` and
`finish`, `place_in_hbm`; each returns or asserts nothing on its own, the tests do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.config import DiskConfig, HbmConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.keys import Namespace
from kvtier.store.cascade import Cascade
from kvtier.store.movers import CopyRoutes
from kvtier.store.page_table import PageTable
from kvtier.store.pages import PageEntry, Tier
from kvtier.store.placement import Placement
from kvtier.store.planner import Planner, RecallPlan
from kvtier.store.stats import StoreCounters
from kvtier.tiers.build import StoreTiers, build_tiers

PAGE_BYTES = 4096
DISK_SLOT_BYTES = 4160  # a 64-byte header, then the page
NAMESPACE = Namespace("parts", "bfloat16", "page-first", 16, PAGE_BYTES)


def key(name: str) -> bytes:
    """A readable 16-byte key: the victims a test names are the pages it named."""
    return name.encode().ljust(16, b".")


@dataclass
class Parts:
    """The pieces of one store, and the steps of its verbs driven one at a time."""

    config: StoreConfig
    tiers: StoreTiers
    table: PageTable
    counters: StoreCounters
    placement: Placement
    planner: Planner
    movers: CopyRoutes
    cascade: Cascade
    lock: threading.RLock

    def entry(self, name: str) -> PageEntry:
        return self.table[NAMESPACE.fingerprint + key(name)]

    def store(self, *names: str) -> None:
        """A store's metadata steps, one page after the other (each one the newest): plan,
        reserve a host slot (evicting), commit."""
        for name in names:
            with self.lock:
                plan = self.planner.plan_store(NAMESPACE, [key(name)])
            failed = self.cascade.reserve(Tier.HOST, plan.to_host).failed
            with self.lock:
                self.planner.commit_store(plan.to_host_indexed, failed)

    def recall_plan(self, *names: str) -> RecallPlan:
        with self.lock:
            return self.planner.plan_recall(NAMESPACE, [key(n) for n in names])

    def finish(self, plan: RecallPlan, failed: dict[bytes, str] | None = None) -> None:
        with self.lock:
            to_drop = self.planner.finish_recall(plan, failed or {})
        self.cascade.drop_from_disk(to_drop)

    def place_in_hbm(self, *names: str) -> None:
        """New pages straight into hbm, with no host copy (as if their host copy had left)."""
        with self.lock:
            plan = self.planner.plan_store(NAMESPACE, [key(n) for n in names])
        reserved = self.cascade.reserve(Tier.HBM, plan.to_host).reserved
        with self.lock:
            self.placement.make_ready(Tier.HBM, reserved)

    def names_in(self, tier: Tier) -> list[str]:
        """The pages with a READY copy in `tier`, by name, in key order."""
        return sorted(e.key.rstrip(b".").decode() for e in self.table.values()
                      if (r := e.residency(tier)) is not None and r.state.name == "READY")

    def check(self) -> list[str]:
        with self.lock:
            return self.placement.check(verify_bytes=False)


PartsFactory = Callable[..., Parts]


@pytest.fixture
def make_parts(tmp_path: Path) -> Iterator[PartsFactory]:
    """`make_parts(host_pages=3, disk_pages=8, hbm_pages=0, write_policy=WRITE_BACK,
    with_bytes=False)`: one store's pieces; their tiers are closed at teardown."""
    made: list[Parts] = []

    def factory(host_pages: int = 3, disk_pages: int = 8, hbm_pages: int = 0,
                write_policy: WritePolicy = WritePolicy.WRITE_BACK,
                with_bytes: bool = False) -> Parts:
        config = StoreConfig(
            hbm=HbmConfig(capacity_bytes=hbm_pages * PAGE_BYTES, chunk_bytes=PAGE_BYTES),
            host=HostConfig(capacity_bytes=host_pages * PAGE_BYTES, chunk_bytes=PAGE_BYTES,
                            policy="lru"),
            disk=DiskConfig(path=tmp_path / f"disk{len(made)}",
                            capacity_bytes=disk_pages * DISK_SLOT_BYTES,
                            chunk_bytes=DISK_SLOT_BYTES, policy="lru",
                            enabled=disk_pages > 0),
            write_policy=write_policy, with_bytes=with_bytes, fit_chunks=False)
        tiers = build_tiers(config)
        table, counters, lock = PageTable(), StoreCounters(), threading.RLock()
        placement = Placement(config, tiers, table, counters)
        movers = CopyRoutes(tiers.host, tiers.hbm, tiers.disk)
        parts = Parts(config, tiers, table, counters, placement,
                      Planner(placement, table, counters), movers,
                      Cascade(placement, movers, lock, counters), lock)
        made.append(parts)
        return parts

    yield factory
    for parts in made:
        parts.tiers.close()
