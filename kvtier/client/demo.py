"""The demo's page workload: chat requests sharing system prompts, through the daemon.

Each request looks up its prefix, recalls the pages the daemon holds into the client's pool,
checks their bytes and stores the rest, the way an engine would. Page content is derived from
the key, so every recalled page is verified byte for byte. Verbs: `run_page_workload`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.client.connection import Client
from kvtier.client.shared_pool import SharedPool
from kvtier.errors import KvtierError
from kvtier.keys import Namespace, prefix_keys
from kvtier.pools.layout import PoolLayout

# A 1B-class model: 16 layers, 8 KV heads of 64 dims, fp16, 16-token pages: 512 KiB a page.
DEMO_LAYOUT = PoolLayout.layer_first(num_pages=128, num_layers=16, page_tokens=16,
                                     num_kv_heads=8, head_dim=64, dtype="float16")
DEMO_NAMESPACE = Namespace(model_id="kvtier-demo/llama-1b", dtype="float16",
                           layout="layer-first", page_tokens=16, page_bytes=DEMO_LAYOUT.page_bytes)


@dataclass(slots=True, frozen=True)
class DemoReport:
    """What the page workload did."""

    num_requests: int
    pages_requested: int
    pages_reused: int
    pages_stored: int
    pages_verified: int
    wrong_pages: int
    elapsed_s: float


def page_content(key: bytes, page_bytes: int) -> np.ndarray:
    """The demo's bytes for the page named `key`: the key repeated, so recalls can be checked."""
    return np.tile(np.frombuffer(key, dtype=np.uint8), page_bytes // len(key))


def _prompts(num_requests: int, seed: int, max_pages: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    system_prompts = [rng.integers(0, 32_000, 512 + 256 * i) for i in range(4)]
    prompts = []
    for _ in range(num_requests):
        system = system_prompts[int(rng.integers(0, len(system_prompts)))]
        turn = rng.integers(0, 32_000, int(rng.integers(128, 512)))
        prompts.append(np.concatenate([system, turn]))
    # Every third request continues an earlier conversation: its whole prompt is a prefix.
    for i in range(2, num_requests, 3):
        earlier = prompts[int(rng.integers(0, i))]
        prompts[i] = np.concatenate([earlier, rng.integers(0, 32_000, 64)])
    return [p[: max_pages * DEMO_NAMESPACE.page_tokens] for p in prompts]


def run_page_workload(client: Client, num_requests: int = 48, seed: int = 0,
                      on_request: Callable[[int], None] | None = None) -> DemoReport:
    """Run `num_requests` seeded chat requests through the daemon; verify every recalled page.

    Raises:
        KvtierError: a page could not be stored (e.g. a full disk).
    """
    page_bytes = DEMO_NAMESPACE.page_bytes
    requested = reused = stored = verified = wrong = 0
    started = time.perf_counter()
    with SharedPool(DEMO_LAYOUT) as pool:
        handle = pool.register(client, DEMO_NAMESPACE)
        page_shape = pool.pages.shape[1:]  # [layers, K/V, segment bytes], strided in the pool
        for index, tokens in enumerate(_prompts(num_requests, seed, DEMO_LAYOUT.num_pages)):
            keys = prefix_keys(DEMO_NAMESPACE, tokens)
            requested += len(keys)
            hit = client.lookup(handle, keys).num_prefix
            if hit:
                recall = client.recall(handle, keys[:hit], range(hit)).result()
                hit = hit if recall.ok else 0
                for page_id, key in enumerate(keys[:hit]):
                    verified += 1
                    wrong += not np.array_equal(
                        pool.pages[page_id], page_content(key, page_bytes).reshape(page_shape))
            reused += hit
            new_ids = range(hit, len(keys))
            for page_id in new_ids:
                pool.pages[page_id] = page_content(keys[page_id], page_bytes).reshape(page_shape)
            result = client.store(handle, keys[hit:], new_ids,
                                  parent_key=keys[hit - 1] if hit else None).result()
            if result.failed:
                problem = next(iter(result.failed.values()))
                raise KvtierError(f"demo request {index}: {len(result.failed)} pages not "
                                  f"stored: {problem}")
            stored += len(new_ids)
            if on_request is not None:
                on_request(index)
    return DemoReport(num_requests, requested, reused, stored, verified, wrong,
                      time.perf_counter() - started)
