"""What several page sizes in one tier cost the store path, against one page size, same run.

Run:

    nice python bench/bench_mixed_sizes.py [--json] [--policy prefix] [--stores 3000]
        [--repeats 3]

One daemon serves every engine of a node, and engines of different models store pages of
different sizes into the same host tier (a tier carves each chunk for one size: a size moving in
empties a chunk of another, `kvtier/store/victims.py`). Workload (seeded, metadata only, as
`bench_policy_cost.py`): stores of 64 new pages into a 1 GiB host tier of 16 MiB chunks, kept
full, each store from one of three namespaces of 16, 24 and 40 KiB pages chosen at random
(`three_sizes_us_per_page`), or all from the first (`one_size_us_per_page`). The two alternate;
medians of `--repeats`. `three_sizes_ratio` is one size's time over three sizes' (1.0: mixing
sizes costs nothing more).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvtier.config import DEFAULT_HOST_POLICY, DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore

PAGE_BYTES = (16 << 10, 24 << 10, 40 << 10)
STORE_PAGES = 64


def run_once(policy: str, num_stores: int, num_sizes: int, seed: int) -> float:
    """Microseconds per stored page of `num_stores` stores over `num_sizes` page sizes."""
    config = StoreConfig(
        host=HostConfig(capacity_bytes=1 << 30, chunk_bytes=16 << 20, policy=policy,
                        prefault=False),
        disk=DiskConfig(enabled=False), write_policy=WritePolicy.WRITE_BACK, with_bytes=False)
    namespaces = [Namespace(f"model-{i}", "bfloat16", "page-first", 16, page_bytes)
                  for i, page_bytes in enumerate(PAGE_BYTES[:num_sizes])]
    rng = random.Random(seed)
    requests = [(namespaces[rng.randrange(num_sizes)],
                 [rng.randbytes(16) for _ in range(STORE_PAGES)]) for _ in range(num_stores)]
    with PageStore(config) as store:
        start = time.perf_counter()
        for namespace, keys in requests:
            store.store(namespace, keys, None)
        elapsed = time.perf_counter() - start
        problems = store.check()
    if problems:
        raise RuntimeError(f"the store is unsound after the run: {problems[:3]}")
    return elapsed / (num_stores * STORE_PAGES) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=DEFAULT_HOST_POLICY,
                        help=f"the host policy (default: the daemon's, {DEFAULT_HOST_POLICY})")
    parser.add_argument("--stores", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    samples: dict[int, list[float]] = {1: [], 3: []}
    for repetition in range(args.repeats):
        for num_sizes in ((1, 3) if repetition % 2 == 0 else (3, 1)):
            samples[num_sizes].append(run_once(args.policy, args.stores, num_sizes, args.seed))
    one, three = statistics.median(samples[1]), statistics.median(samples[3])
    report = {"policy": args.policy, "one_size_us_per_page": one,
              "three_sizes_us_per_page": three, "three_sizes_ratio": one / three}
    if args.json:
        print(json.dumps(report))
        return
    print(f"host policy {args.policy}: one page size {one:.2f} us a stored page, three sizes "
          f"{three:.2f}; ratio {one / three:.3f} (1.0: mixing sizes costs nothing more)")


if __name__ == "__main__":
    main()
