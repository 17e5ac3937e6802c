"""What a host policy costs per stored page on the store path, beside LRU in the same run.

Run:

    nice python bench/bench_policy_cost.py [--json] [--policies lru,prefix,adaptive]
        [--capacity-pages 8192] [--num-pages 65536] [--repeats 3] [--seed 0]
        [--collector python|daemon]

Workload (seeded): chains of 64 new pages, each stored in one `PageStore.store` call; half the
chains continue an earlier chain (its last key is the parent), and before each store the chain
it continues is recalled (hits, which the policies count). The host tier holds
`--capacity-pages` pages, so once it is full every stored page evicts one.

- `metadata_us_per_page`: a metadata-only store (`StoreConfig(with_bytes=False)`, as the
  replay uses): the store's page table, slot accounting and the policy, no copies. Median over
  `--repeats` of the whole run's seconds divided by the pages stored; `policy_extra_us` is
  that minus LRU's.
- `copy_us_per_page`: the same with 2 MiB pages and bytes (a host tier of 256 pages, 4096
  stored), the copy included: the cost a daemon sees. `copy_ratio_to_lru` is LRU's time over
  the policy's (1.0: no slower).
- `pinned_us_per_victim`: the policy alone, a tier of `--capacity-pages` in chains of 4 pages,
  the first 2048 pages of its order pinned (a client's leases on 512 requests): microseconds per
  victim of a store that evicts 64 (after one victim that brings the policy's tables up to
  date), taken from one `victims` iterator as the store does (each victim used to search past
  every pinned leaf again). Median of `--repeats`.

`--collector daemon` keeps the garbage collector as the daemon does (`kvtier.daemon.heap`: the
survivors of young collections frozen every 100 ms, so collections never walk the page table
and the policies' records again); the default, CPython's own, is what an embedded store pays.

One warm-up run of each policy is excluded; the policies alternate between repetitions.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import numpy as np

from kvtier.config import DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.daemon.heap import FREEZE_INTERVAL_S, HeapKeeper
from kvtier.keys import Namespace
from kvtier.policies import EvictionPolicy, make_policy
from kvtier.store.page_store import PageStore
from kvtier.tiers.host import HOST_SLOT_ALIGNMENT
from kvtier.tiers.slots import align_up

CHAIN_PAGES = 64
COPY_PAGE_BYTES = 2 << 20
COPY_CAPACITY_PAGES = 256
COPY_NUM_PAGES = 4096


def make_chains(num_pages: int, seed: int) -> list[tuple[int | None, list[bytes]]]:
    """(index of the chain it continues or None, keys) for each chain."""
    rng = random.Random(seed)
    chains: list[tuple[int | None, list[bytes]]] = []
    for number in range(num_pages // CHAIN_PAGES):
        keys = [rng.randbytes(16) for _ in range(CHAIN_PAGES)]
        continues = rng.randrange(number) if number and rng.random() < 0.5 else None
        chains.append((continues, keys))
    return chains


def run_once(policy: str, chains: list[tuple[int | None, list[bytes]]], capacity_pages: int,
             page_bytes: int, with_bytes: bool, collector: str = "python") -> float:
    """Seconds to store every chain (with its recall) through a fresh store, the garbage
    collector as CPython keeps it (`collector` "python") or as the daemon does ("daemon")."""
    slot_bytes = align_up(page_bytes, HOST_SLOT_ALIGNMENT)
    config = StoreConfig(
        host=HostConfig(capacity_bytes=capacity_pages * slot_bytes,
                        chunk_bytes=capacity_pages * slot_bytes, policy=policy,
                        prefault=with_bytes),
        disk=DiskConfig(enabled=False), write_policy=WritePolicy.WRITE_BACK,
        with_bytes=with_bytes)
    namespace = Namespace("bench-policy", "bfloat16", "page-first", 16, page_bytes)
    pages = out = None
    if with_bytes:
        pages = np.random.default_rng(0).integers(0, 255, (CHAIN_PAGES, page_bytes), np.uint8)
        out = np.zeros_like(pages)
    keeper = HeapKeeper() if collector == "daemon" else None
    with PageStore(config) as store:
        if keeper is not None:
            keeper.freeze_survivors()
        start = tended = time.perf_counter()
        for continues, keys in chains:
            parent = None
            if continues is not None:
                earlier = chains[continues][1]
                store.recall(namespace, earlier, out)
                parent = earlier[-1]
            store.store(namespace, keys, pages, parent_key=parent)
            if keeper is not None and time.perf_counter() - tended >= FREEZE_INTERVAL_S:
                keeper.tend()  # as the daemon's loop does between requests
                tended = time.perf_counter()
        elapsed = time.perf_counter() - start
    gc.unfreeze()
    return elapsed


def measure(policies: list[str], chains, capacity_pages: int, page_bytes: int,
            with_bytes: bool, repeats: int, collector: str = "python") -> dict[str, float]:
    """Median microseconds per stored page of each policy (policies alternate)."""
    num_pages = len(chains) * CHAIN_PAGES
    seconds: dict[str, list[float]] = {policy: [] for policy in policies}
    for repetition in range(-1, repeats):
        shift = (repetition + 1) % len(policies)
        for policy in policies[shift:] + policies[:shift]:
            elapsed = run_once(policy, chains, capacity_pages, page_bytes, with_bytes, collector)
            if repetition >= 0:
                seconds[policy].append(elapsed)
    return {policy: statistics.median(s) / num_pages * 1e6 for policy, s in seconds.items()}


def filled_policy(policy_name: str, capacity_pages: int, chain_pages: int) -> EvictionPolicy:
    """A policy holding `capacity_pages` keys stored in chains of `chain_pages`, one call each."""
    policy = make_policy(policy_name, capacity_pages)
    keys = [number.to_bytes(16, "little") for number in range(capacity_pages)]
    for start in range(0, capacity_pages, chain_pages):
        run = [(keys[start + i], keys[start + i - 1] if i else None) for i in range(chain_pages)]
        policy.admit_many(run)
        policy.on_insert_many(run)
    return policy


def pinned_us_per_victim(policy_name: str, capacity_pages: int, repeats: int,
                         num_pinned: int = 2048, num_victims: int = 64) -> float:
    """Microseconds per victim of a store evicting `num_victims` past `num_pinned` pinned pages
    (the first of the policy's order); median of `repeats`."""
    probe = filled_policy(policy_name, capacity_pages, 4)
    in_order = probe.victims(lambda key: True)
    pinned = {next(in_order) for _ in range(num_pinned)}
    in_order.close()
    samples = []
    for _ in range(repeats):
        policy = filled_policy(policy_name, capacity_pages, 4)
        policy.choose_victim(lambda key: key not in pinned)  # the table and shadows caught up
        start = time.perf_counter()
        in_order = policy.victims(lambda key: key not in pinned)
        for _ in range(num_victims):
            next(in_order)
        in_order.close()
        samples.append((time.perf_counter() - start) / num_victims * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="lru,prefix,adaptive")
    parser.add_argument("--capacity-pages", type=int, default=8192)
    parser.add_argument("--num-pages", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--collector", choices=("python", "daemon"), default="python",
                        help="the garbage collector as CPython keeps it, or as the daemon does "
                        "(survivors frozen every 100 ms: kvtier.daemon.heap)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    policies = ["lru"] + [p for p in args.policies.split(",") if p and p != "lru"]
    metadata = measure(policies, make_chains(args.num_pages, args.seed), args.capacity_pages,
                       1 << 20, False, args.repeats, args.collector)
    copy = measure(policies, make_chains(COPY_NUM_PAGES, args.seed + 1), COPY_CAPACITY_PAGES,
                   COPY_PAGE_BYTES, True, args.repeats, args.collector)
    report = {policy: {"metadata_us_per_page": metadata[policy],
                       "policy_extra_us": metadata[policy] - metadata["lru"],
                       "copy_us_per_page": copy[policy],
                       "copy_ratio_to_lru": copy["lru"] / copy[policy],
                       "pinned_us_per_victim": pinned_us_per_victim(
                           policy, args.capacity_pages, args.repeats)}
              for policy in policies}
    if args.json:
        print(json.dumps(report))
        return
    print(f"{'policy':10} {'metadata us/page':>17} {'extra vs lru':>13} "
          f"{'2 MiB copy us/page':>19} {'lru / policy':>13} {'pinned us/victim':>17}")
    for policy, row in report.items():
        print(f"{policy:10} {row['metadata_us_per_page']:17.2f} {row['policy_extra_us']:13.2f} "
              f"{row['copy_us_per_page']:19.1f} {row['copy_ratio_to_lru']:13.3f} "
              f"{row['pinned_us_per_victim']:17.1f}")


if __name__ == "__main__":
    main()
