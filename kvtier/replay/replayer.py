"""Trace replay: run a request trace through the store's own page table, tiers and policies.

The replay drives a metadata-only `PageStore` (`StoreConfig(with_bytes=False)`: slot accounting,
placement, the eviction cascade and the policies all run, no page bytes exist), so what it
measures is what the daemon would do. Per request: `lookup` its pages (present ones are block
hits, the leading run of them prefix hits: what an engine can reuse), `recall` the present ones
(a use for the policies; a disk hit is promoted), then `store` the missing full pages, one call
per contiguous run with the page before the run as parent. A request's partly filled last page
counts as a reference but is never stored: engines store whole pages only.

Verbs: `read_trace`, `parse_capacity`, `replay`, `opt_hit_ratio`, and
`synthetic_conversations` (a seeded trace family for checking policies beyond one trace file).
"""

from __future__ import annotations

import heapq
import json
import math
import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import DEFAULT_HOST_POLICY, DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.errors import ConfigError, TraceError
from kvtier.keys import Namespace
from kvtier.replay.belady import opt_hits
from kvtier.sizes import parse_bytes
from kvtier.store.page_store import PageStore
from kvtier.store.pages import Tier
from kvtier.tiers.disk import DISK_ALIGNMENT
from kvtier.tiers.host import HOST_SLOT_ALIGNMENT
from kvtier.tiers.page_format import HEADER_BYTES
from kvtier.tiers.slots import align_up

DEFAULT_PAGE_TOKENS = 512  # the Mooncake traces' page
DEFAULT_PAGE_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a Mooncake-format trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # chained prefix page ids: a shared id means a shared prefix

    def num_full_pages(self, page_tokens: int) -> int:
        """Pages completely filled by the input: the ones an engine stores."""
        return min(len(self.hash_ids), self.input_length // page_tokens)


def read_trace(path: Path) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace: one object a line with `timestamp`, `input_length`,
    `output_length` and `hash_ids`. Blank lines are skipped.

    Raises:
        TraceError: the file is missing or holds no request, or a line is not UTF-8 or not such
            an object (the message names the file and line).
    """
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    requests = []
    for number, raw_line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:  # line by line, so a stray byte is reported with its line
            line = raw_line.decode()
        except UnicodeDecodeError as exc:
            raise TraceError(f"{where}: not UTF-8 text (byte 0x{raw_line[exc.start]:02x} at "
                             f"column {exc.start + 1})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [f for f in ("input_length", "hash_ids") if f not in row]
        if missing:
            raise TraceError(f"{where}: missing field {', '.join(missing)}")
        hash_ids = row["hash_ids"]
        if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and 0 <= h < 1 << 128 for h in hash_ids):
            raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
        values = [row.get("timestamp", 0), row["input_length"], row.get("output_length", 0)]
        if not all(isinstance(v, int) and v >= 0 for v in values):
            raise TraceError(f"{where}: timestamp, input_length and output_length must be "
                             f"non-negative integers")
        requests.append(TraceRequest(values[0], values[1], values[2], tuple(hash_ids)))
    if not requests:
        raise TraceError(f"{path}: no requests in the trace (the file is empty or blank)")
    return requests


def count_distinct_pages(requests: Sequence[TraceRequest]) -> int:
    """Distinct page ids in the trace: the base of percentage capacities."""
    return len({h for request in requests for h in request.hash_ids})


def parse_capacity(text: str, num_distinct_pages: int, page_bytes: int) -> int:
    """A tier capacity in pages from "9140" (pages), "5%" (of the trace's distinct pages) or a
    byte size such as "64GiB" (divided by `page_bytes`).

    Raises:
        ConfigError: the text is none of these.
    """
    text = text.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise ConfigError(f"not a percentage: {text!r} (try 5%)") from None
        if not 0 <= share <= 100:
            raise ConfigError(f"a capacity share must be within 0% and 100%, got {text!r}")
        return math.floor(num_distinct_pages * share / 100 + 0.5)  # nearest, halves up
    if text.isdigit():
        return int(text)
    try:
        return parse_bytes(text) // page_bytes
    except ConfigError:
        raise ConfigError(f"not a capacity: {text!r} (give pages: 9140, a share of the trace's "
                          f"distinct pages: 5%, or bytes: 64GiB)") from None


@dataclass(slots=True, frozen=True)
class ReplayConfig:
    """What to replay with: tier sizes in pages (0 disables the disk), policies, write policy."""

    host_pages: int
    host_policy: str = DEFAULT_HOST_POLICY
    disk_pages: int = 0
    disk_policy: str = "lru"
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    page_tokens: int = DEFAULT_PAGE_TOKENS
    page_bytes: int = DEFAULT_PAGE_BYTES

    def __post_init__(self) -> None:
        if self.host_pages < 1:
            raise ConfigError(f"the host tier needs at least one page, got {self.host_pages}")
        if self.disk_pages < 0 or self.page_tokens < 1 or self.page_bytes < 1:
            raise ConfigError("disk pages, page tokens and page bytes must be positive")


@dataclass(slots=True, frozen=True)
class TierReplayStats:
    """One tier's share of a replay: hits, and hits within each request's leading run."""

    tier: str
    hits: int
    prefix_hits: int
    block_hit_ratio: float
    prefix_hit_ratio: float


@dataclass(slots=True, frozen=True)
class ReplayResult:
    """Figures of one replay; ratios are over every page reference of the trace."""

    num_requests: int
    num_references: int
    hits: int
    prefix_hits: int
    block_hit_ratio: float
    prefix_hit_ratio: float
    tiers: tuple[TierReplayStats, ...]
    bytes_written_disk: int
    bytes_promoted: int
    pages_demoted: int
    pages_promoted: int


def replay(requests: Sequence[TraceRequest], config: ReplayConfig,
           on_request: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay `requests` through a metadata-only `PageStore` configured by `config`."""
    host_slot_bytes = align_up(config.page_bytes, HOST_SLOT_ALIGNMENT)
    disk_slot_bytes = align_up(HEADER_BYTES + config.page_bytes, DISK_ALIGNMENT)
    host_bytes = config.host_pages * host_slot_bytes
    disk_bytes = max(1, config.disk_pages) * disk_slot_bytes
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as scratch:
        # One chunk per tier: the capacity in pages is then exact (no partly used chunk).
        store_config = StoreConfig(
            host=HostConfig(capacity_bytes=host_bytes, chunk_bytes=host_bytes,
                            policy=config.host_policy, prefault=False),
            disk=DiskConfig(path=Path(scratch) / "disk", capacity_bytes=disk_bytes,
                            chunk_bytes=disk_bytes, policy=config.disk_policy,
                            enabled=config.disk_pages > 0),
            write_policy=config.write_policy, with_bytes=False, fit_chunks=False)
        namespace = Namespace("trace-replay", "none", "replay", config.page_tokens,
                              config.page_bytes)
        hits = {Tier.HOST: 0, Tier.DISK: 0}
        prefix_hits = {Tier.HOST: 0, Tier.DISK: 0}
        num_references = 0
        with PageStore(store_config) as store:
            for index, request in enumerate(requests):
                keys = [h.to_bytes(16, "big") for h in request.hash_ids]
                num_references += len(keys)
                found = store.lookup(namespace, keys)
                for position, tier in enumerate(found.tiers):
                    if tier is not None:
                        hits[tier] += 1
                        prefix_hits[tier] += position < found.num_prefix
                present = [k for k, tier in zip(keys, found.tiers) if tier is not None]
                if present:
                    store.recall(namespace, present, None)
                _store_missing(store, namespace, keys, found.tiers,
                               request.num_full_pages(config.page_tokens))
                if on_request is not None:
                    on_request(index)
            stats = store.stats()
    total = max(1, num_references)
    tiers = tuple(
        TierReplayStats(tier.label, hits[tier], prefix_hits[tier], hits[tier] / total,
                        prefix_hits[tier] / total)
        for tier in (Tier.HOST, Tier.DISK) if tier is Tier.HOST or config.disk_pages > 0)
    num_hits, num_prefix_hits = sum(hits.values()), sum(prefix_hits.values())
    disk_written = stats.tier("disk").bytes_written if config.disk_pages > 0 else 0
    return ReplayResult(len(requests), num_references, num_hits, num_prefix_hits,
                        num_hits / total, num_prefix_hits / total, tiers, disk_written,
                        stats.counters.promotions * config.page_bytes, stats.counters.demotions,
                        stats.counters.promotions)


def _store_missing(store: PageStore, namespace: Namespace, keys: list[bytes],
                   tiers: list[Tier | None], num_full: int) -> None:
    # One store per contiguous run of missing full pages, so each run's parent is exact.
    run_start = None
    for position in range(num_full + 1):
        missing = position < num_full and tiers[position] is None
        if missing and run_start is None:
            run_start = position
        elif not missing and run_start is not None:
            parent = keys[run_start - 1] if run_start else None
            store.store(namespace, keys[run_start:position], None, parent_key=parent)
            run_start = None


def opt_hit_ratio(requests: Sequence[TraceRequest], capacity_pages: int,
                  page_tokens: int = DEFAULT_PAGE_TOKENS) -> float:
    """Belady OPT's block hit ratio for one tier of `capacity_pages`, same storing rule as
    `replay` (partly filled last pages are never stored)."""
    references: list[int] = []
    storable: list[bool] = []
    for request in requests:
        num_full = request.num_full_pages(page_tokens)
        references.extend(request.hash_ids)
        storable.extend(i < num_full for i in range(len(request.hash_ids)))
    return opt_hits(references, storable, capacity_pages) / max(1, len(references))


def synthetic_conversations(num_requests: int, *, seed: int = 0, num_prompts: int = 4,
                            document_share: float = 0.3, num_documents: int = 300,
                            continue_probability: float = 0.4, think_requests: float = 500.0,
                            think_sigma: float = 1.0, max_new_pages: int = 40,
                            page_tokens: int = DEFAULT_PAGE_TOKENS) -> list[TraceRequest]:
    """A seeded Mooncake-format trace of conversations, for checking policies on traffic that
    no constant of theirs was chosen on.

    Each request either continues a conversation that is due or starts a new one: a shared
    system prompt (1-4 pages, Zipf over `num_prompts`), with probability `document_share` a
    shared document under it (4-60 pages, Zipf over `num_documents`), then 1..`max_new_pages`
    private pages and a partly filled last page. A turn is continued with
    `continue_probability`, after a log-normal think time of mean `think_requests` requests and
    shape `think_sigma`; the continuation repeats the turn's full pages and adds its own. Page ids
    are chained as a prefix hash would be: a page id means one prefix.
    """
    rng = random.Random(seed)
    next_id = 0

    def new_pages(count: int) -> list[int]:
        nonlocal next_id
        next_id += count
        return list(range(next_id - count, next_id))

    def zipf(count: int) -> int:
        return min(count - 1, int(rng.paretovariate(1.2)) - 1)

    prompts = [new_pages(rng.randint(1, 4)) for _ in range(num_prompts)]
    documents: dict[tuple[int, int], list[int]] = {}  # (prompt, document): a document's pages
    due: list[tuple[int, float, list[int]]] = []  # (request index, tie-break, full pages)
    mu = math.log(think_requests) - think_sigma ** 2 / 2  # log-normal of mean think_requests
    requests = []
    for index in range(num_requests):
        if due and due[0][0] <= index:
            chain = heapq.heappop(due)[2]
        else:
            prompt = zipf(num_prompts)
            chain = list(prompts[prompt])
            if rng.random() < document_share:
                document = (prompt, zipf(num_documents))
                if document not in documents:
                    documents[document] = new_pages(rng.randint(4, 60))
                chain += documents[document]
        chain = chain + new_pages(rng.randint(1, max_new_pages))
        input_length = page_tokens * len(chain) + rng.randint(1, page_tokens - 1)
        requests.append(TraceRequest(index * 300, input_length, 100,
                                     tuple(chain + new_pages(1))))
        if rng.random() < continue_probability:
            wait = max(1, int(rng.lognormvariate(mu, think_sigma)))
            heapq.heappush(due, (index + wait, rng.random(), chain))
    return requests
