"""The demo workload: chat requests sharing system prompts, run through a PageStore.

Each request looks up its prefix, recalls the pages the store holds, checks their bytes and stores
the rest, the way an engine would. Page content is derived from the key, so every recalled page is
verified byte for byte. Verbs: `run_demo`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.errors import KvtierError
from kvtier.keys import Namespace, prefix_keys
from kvtier.store import PageStore

# A 1B-class model: 16 layers, 8 KV heads of 64 dims, fp16, 16-token pages: 512 KiB a page.
DEMO_LAYERS, DEMO_KV_HEADS, DEMO_HEAD_DIM, DEMO_DTYPE_BYTES, DEMO_PAGE_TOKENS = 16, 8, 64, 2, 16
DEMO_NAMESPACE = Namespace(
    model_id="kvtier-demo/llama-1b",
    dtype="float16",
    layout="page-first",
    page_tokens=DEMO_PAGE_TOKENS,
    page_bytes=DEMO_LAYERS * 2 * DEMO_PAGE_TOKENS * DEMO_KV_HEADS * DEMO_HEAD_DIM * DEMO_DTYPE_BYTES,
)


@dataclass(slots=True, frozen=True)
class DemoReport:
    """What the demo did, for the CLI to print."""

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


def _prompts(num_requests: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    system_prompts = [rng.integers(0, 32_000, 512 + 256 * i) for i in range(4)]
    prompts = []
    for _ in range(num_requests):
        system = system_prompts[int(rng.integers(0, len(system_prompts)))]
        turn = rng.integers(0, 32_000, int(rng.integers(128, 768)))
        prompts.append(np.concatenate([system, turn]))
    # Every third request continues an earlier conversation: its whole prompt is a prefix.
    for i in range(2, num_requests, 3):
        earlier = prompts[int(rng.integers(0, i))]
        prompts[i] = np.concatenate([earlier, rng.integers(0, 32_000, 64)])
    return prompts


def run_demo(store: PageStore, num_requests: int = 48, seed: int = 0,
             on_request: Callable[[int], None] | None = None) -> DemoReport:
    """Run `num_requests` seeded chat requests through `store`; verify every recalled page.

    Raises:
        KvtierError: a page could not be stored (e.g. a full disk).
    """
    namespace = DEMO_NAMESPACE
    page_bytes = namespace.page_bytes
    requested = reused = stored = verified = wrong = 0
    started = time.perf_counter()
    for index, tokens in enumerate(_prompts(num_requests, seed)):
        keys = prefix_keys(namespace, tokens)
        requested += len(keys)
        hit = store.lookup(namespace, keys).num_prefix
        if hit:
            out = np.empty((hit, page_bytes), dtype=np.uint8)
            recall = store.recall(namespace, keys[:hit], out)
            for row, key in enumerate(keys[:hit]):
                if key in recall.recalled:
                    verified += 1
                    wrong += not np.array_equal(out[row], page_content(key, page_bytes))
            hit = len(recall.recalled) if recall.ok else 0
        reused += hit
        new_keys = keys[hit:]
        pages = np.stack([page_content(key, page_bytes) for key in new_keys]) if new_keys else (
            np.empty((0, page_bytes), dtype=np.uint8))
        result = store.store(namespace, new_keys, pages)
        if result.failed:
            problem = next(iter(result.failed.values()))
            raise KvtierError(f"demo request {index}: {len(result.failed)} pages not stored: {problem}")
        stored += len(result.stored)
        if on_request is not None:
            on_request(index)
    return DemoReport(num_requests, requested, reused, stored, verified, wrong,
                      time.perf_counter() - started)
