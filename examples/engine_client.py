"""An engine attached to the kvtier daemon with the plain client: the whole life of a prefix.

Run (with a daemon started by `kvtier serve`):

    python examples/engine_client.py [--socket PATH]

It plays a small engine without a GPU: a page-first KV pool in shared memory, two prompts that
share a 4-page system prompt. The first prompt's pages are stored; the second looks its prefix
up, pins it, recalls it into free pool pages and checks every byte; then the failures an engine
must handle are shown on purpose: a recall of a deleted page (reported missing, the page left
untouched) and a request the daemon refuses (an error reply with a code). Exits 0 when every
step did what docs/engine-guide.md says it does.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from kvtier import Client, DaemonReplyError, Namespace, PoolLayout, SharedPool, prefix_keys

PAGE_TOKENS = 16
NUM_POOL_PAGES = 32


def fake_prefill(pool: SharedPool, page_ids: list[int], token_ids: list[int]) -> None:
    """Stand-in for the model: page i's KV is a function of the tokens up to its end."""
    for i, page_id in enumerate(page_ids):
        seed = hash(tuple(token_ids[: (i + 1) * PAGE_TOKENS])) & 0xFFFF_FFFF
        pool.page(page_id)[:] = np.random.default_rng(seed).integers(
            0, 256, pool.page(page_id).shape, dtype=np.uint8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", default=None, help="the daemon's socket (default: as "
                                                       "`kvtier serve` chooses it)")
    args = parser.parse_args()

    # 1. The pool's layout and the namespace its pages belong to.
    layout = PoolLayout.page_first(num_pages=NUM_POOL_PAGES, num_layers=4,
                                   page_tokens=PAGE_TOKENS, num_kv_heads=2, head_dim=64,
                                   dtype="bfloat16")
    namespace = Namespace("example-model", "bfloat16", "page-first", PAGE_TOKENS,
                          layout.page_bytes)
    system_prompt = list(range(1000, 1000 + 4 * PAGE_TOKENS))  # 4 full pages
    first = system_prompt + list(range(1, 1 + 2 * PAGE_TOKENS + 5))  # + 2 pages and 5 tokens
    second = system_prompt + list(range(500, 500 + PAGE_TOKENS))

    with Client(args.socket, client_name="engine-example") as client, \
            SharedPool(layout) as pool:
        handle = pool.register(client, namespace)

        # 2. Prefill the first prompt into pool pages 0..5, then store its full pages. The
        # writes are done (numpy copies are synchronous); the pages must stay untouched until
        # the store's result() returns, because the daemon copies them after this call.
        first_keys = prefix_keys(namespace, first)  # 6 keys: the trailing 5 tokens have none
        first_pages = list(range(len(first_keys)))
        fake_prefill(pool, first_pages, first)
        stored = client.store(handle, first_keys, first_pages).result()
        if stored.failed:  # not cached; the engine goes on, the pages are recomputed next time
            print(f"store failed for {len(stored.failed)} pages: {stored.failed}")
            return 1
        print(f"stored {stored.num_done} pages of prompt 1")

        # 3. The second prompt: look up its keys, pin the hit so it cannot be evicted before
        # the recall, recall it into free pool pages, release the pin.
        second_keys = prefix_keys(namespace, second)
        hit = client.lookup(handle, second_keys)
        print(f"prompt 2: {hit.num_prefix} of {len(second_keys)} pages held, tiers {hit.tiers}")
        if hit.num_prefix != 4:
            return 1
        lease, not_held = client.pin(handle, second_keys[: hit.num_prefix], ttl_s=30)
        free_pages = list(range(16, 16 + hit.num_prefix))
        recalled = client.recall(handle, second_keys[: hit.num_prefix], free_pages).result()
        client.unpin(lease)
        if not recalled.ok or not_held:
            print(f"recall fell short: failed {recalled.failed}, missing {recalled.missing}")
            return 1
        same = all(np.array_equal(pool.page(a), pool.page(b))
                   for a, b in zip(first_pages[:4], free_pages))
        print(f"recalled {recalled.num_done} pages from {recalled.tiers}; "
              f"byte-identical: {same}")
        if not same:
            return 1

        # 4. A page the node no longer holds: the recall reports it missing and leaves its
        # pool page untouched; the engine recomputes from the first page it did not get.
        client.delete(handle, first_keys[4:5])
        target = [24, 25]
        pool.page(25)[:] = 7
        partial = client.recall(handle, first_keys[3:5], target).result()
        untouched = bool((pool.page(25) == 7).all())
        print(f"recall after a delete: {partial.num_done} done, "
              f"{len(partial.missing)} missing, missing page untouched: {untouched}")
        if partial.missing != [first_keys[4]] or not untouched:
            return 1

        # 5. A request the daemon refuses fails that request only, with a code.
        try:
            client.recall(handle, first_keys[:1], [NUM_POOL_PAGES]).result()
        except DaemonReplyError as exc:
            print(f"refused as expected: [{exc.code}] {exc}")
        else:
            return 1
        client.ping()  # the connection still serves
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
