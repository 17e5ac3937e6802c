"""After a large delete the store's tables give their room back, whatever the policy."""

from __future__ import annotations

import sys

import pytest

from kvtier.config import DiskConfig, HostConfig, StoreConfig
from kvtier.daemon.lookup_plane import LookupPlane
from kvtier.keys import Namespace
from kvtier.policies import POLICY_NAMES
from kvtier.store.page_store import PageStore

NUM_PAGES = 20_000
NAMESPACE = Namespace("shrink", "bfloat16", "page-first", 16, 4096)


def large_dicts(root: object, min_bytes: int) -> list[str]:
    """Paths of the dicts of at least `min_bytes` reachable from `root` through kvtier's own
    objects (attributes, and the entries of small containers: tiers, namespaces)."""
    found: list[str] = []
    seen: set[int] = set()

    def visit(obj: object, path: str) -> None:
        if id(obj) in seen or isinstance(obj, (bytes, str, int, float)):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            if sys.getsizeof(obj) >= min_bytes:
                found.append(f"{path} ({sys.getsizeof(obj) >> 10} KiB, {len(obj)} keys)")
            if len(obj) <= 64:
                for name, value in list(obj.items()):
                    visit(value, f"{path}[{name!r}]")
            if type(obj) is dict:
                return  # a dict of kvtier's own (the page table) has attributes to visit too
        if isinstance(obj, (list, tuple)):
            if len(obj) <= 64:
                for number, value in enumerate(obj):
                    visit(value, f"{path}[{number}]")
            return
        if not type(obj).__module__.startswith("kvtier"):
            return
        attributes = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(obj, name):
                    attributes[name] = getattr(obj, name)
        for name, value in attributes.items():
            visit(value, f"{path}.{name}")

    visit(root, type(root).__name__)
    return found


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_large_delete_leaves_no_large_table_behind(policy: str) -> None:
    config = StoreConfig(host=HostConfig(capacity_bytes=NUM_PAGES * 4096, policy=policy,
                                         prefault=False),
                         disk=DiskConfig(enabled=False), with_bytes=False)
    keys = [number.to_bytes(16, "big") for number in range(NUM_PAGES)]
    with PageStore(config) as store:
        plane = LookupPlane(store)
        try:
            store.store(NAMESPACE, keys[:NUM_PAGES // 2], None)
            store.store(NAMESPACE, keys[NUM_PAGES // 2:], None, parent_key=keys[NUM_PAGES // 2 - 1])
            store.lookup(NAMESPACE, keys)
            grown = large_dicts(store, 256 << 10)
            assert len(grown) >= 3, grown  # the page table, slot map, policy at least
            assert store.delete(NAMESPACE, keys[10:]) == NUM_PAGES - 10
            assert store.shrink() > 0
            assert large_dicts(store, 64 << 10) == []
            assert store.check() == []
            # Still a working store: what stayed is found, what comes in is kept.
            assert store.lookup(NAMESPACE, keys).num_prefix == 10
            store.store(NAMESPACE, keys[10:20], None, parent_key=keys[9])
            assert store.lookup(NAMESPACE, keys).num_prefix == 20
            assert store.check() == []
        finally:
            plane.close()
