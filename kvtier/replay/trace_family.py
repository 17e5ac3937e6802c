"""A family of traces to judge eviction policies on, and the evaluation over it.

One trace rewards whatever fits it; a policy worth being the default holds across traffic of
different shapes. The family (`family_members`): the Mooncake conversation trace and its two
halves (when the trace is found, see `conversation_trace_path`), the seeded synthetic
conversations of `kvtier.replay.replayer.synthetic_conversations` with the three presets the tests
use, and the generators of `kvtier.replay.workloads` (RAG, agent loops, short chats, prompt bursts,
a mix, document QA with Poisson arrivals in three shapes).

`evaluate` replays every policy on every member at every capacity on a process pool (each worker
builds a trace once and keeps it) and reports, per cell, each policy's block hit ratio as a
fraction of Belady's OPT for the same capacity; `summarize` gives each policy's geometric mean and
worst case over the cells, and its worst margin against LRU in points of OPT.

Verbs: `conversation_trace_path`, `family_members`, `load_member`, `evaluate`, `summarize`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from kvtier.replay import workloads
from kvtier.replay.replayer import (
    ReplayConfig,
    TraceRequest,
    count_distinct_pages,
    opt_hit_ratio,
    parse_capacity,
    read_trace,
    replay,
    synthetic_conversations,
)

CONVERSATION_TRACE_NAME = "mooncake_conversation_trace.jsonl"
_REPO_ROOT = Path(__file__).resolve().parents[2]  # kvtier/replay/ -> the repository
# Where the conversation trace may be, first found wins: $KVTIER_TRACES, the repository's own
# traces/ folder, and the shared folder beside the repository.
_TRACE_DIRS = (_REPO_ROOT / "traces", _REPO_ROOT.parent.parent / "shared" / "traces",
               _REPO_ROOT.parent / "shared" / "traces")
FAMILY_CAPACITIES = ("1%", "5%", "25%")
BASELINE_POLICY = "lru"
SYNTHETIC_REQUESTS = 8000
# The presets of tests/replay/test_replay.py: quick conversations, slow ones, document-heavy
# traffic.
SYNTHETIC_PRESETS: dict[str, dict] = {
    "synthetic conversations": {},
    "synthetic slow conversations": dict(seed=1, think_requests=2000.0,
                                         continue_probability=0.35, think_sigma=1.5),
    "synthetic shared documents": dict(seed=2, document_share=0.7, num_documents=100,
                                       continue_probability=0.3, think_requests=1500.0,
                                       think_sigma=1.5),
}
WORKLOADS: dict[str, Callable[[int], list[TraceRequest]]] = {
    "rag": workloads.rag_requests,
    "agent loops": workloads.agent_requests,
    "short chats": workloads.short_chat_requests,
    "prompt bursts": workloads.prompt_burst_requests,
    "mix": workloads.mixed_requests,
    # Document QA with Poisson arrivals, in three shapes: sizes, popularity and seeds varied.
    "document qa": workloads.document_qa_requests,
    "document qa (many short documents)": partial(
        workloads.document_qa_requests, seed=16, num_documents=1500, document_pages=(2, 16),
        popularity_alpha=1.0),
    "document qa (few long documents)": partial(
        workloads.document_qa_requests, seed=17, num_documents=80, document_pages=(20, 120),
        popularity_alpha=0.5, num_prompts=4),
}
WORKLOAD_REQUESTS = 6000


def conversation_trace_path() -> Path | None:
    """The Mooncake conversation trace, or None when none of the known places has it."""
    dirs = [Path(os.environ["KVTIER_TRACES"])] if os.environ.get("KVTIER_TRACES") else []
    for directory in (*dirs, *_TRACE_DIRS):
        if (directory / CONVERSATION_TRACE_NAME).exists():
            return directory / CONVERSATION_TRACE_NAME
    return None


def family_members(trace: Path | None = None) -> list[str]:
    """Names of the family's traces; the conversation trace and its halves come first when
    `trace` (default: `conversation_trace_path()`) exists."""
    trace = trace or conversation_trace_path()
    members = []
    if trace is not None and trace.exists():
        members += ["conversation", "conversation 1st half", "conversation 2nd half"]
    return members + list(SYNTHETIC_PRESETS) + list(WORKLOADS)


def load_member(name: str, trace: Path | None = None) -> list[TraceRequest]:
    """The requests of family member `name` (see `family_members`).

    Raises:
        KeyError: no member has that name.
        TraceError: the conversation trace cannot be read.
    """
    if name.startswith("conversation"):
        path = trace or conversation_trace_path()
        if path is None:
            raise KeyError(f"{name}: no conversation trace found")
        requests = read_trace(path)
        half = (len(requests) + 1) // 2  # the halves of design-notes.md: 6,015 and 6,016 lines
        return {"conversation": requests, "conversation 1st half": requests[:half],
                "conversation 2nd half": requests[half:]}[name]
    if name in SYNTHETIC_PRESETS:
        return synthetic_conversations(SYNTHETIC_REQUESTS, **SYNTHETIC_PRESETS[name])
    return WORKLOADS[name](WORKLOAD_REQUESTS)


@dataclass(slots=True)
class FamilyCell:
    """One trace at one capacity: OPT and each policy's block and prefix hit ratios."""

    trace: str
    capacity: str
    capacity_pages: int
    opt_hit_ratio: float = 0.0
    block_hit_ratio: dict[str, float] = field(default_factory=dict)
    prefix_hit_ratio: dict[str, float] = field(default_factory=dict)

    def opt_fraction(self, policy: str) -> float:
        """The policy's block hit ratio as a fraction of OPT's (1 when OPT hits nothing)."""
        if not self.opt_hit_ratio:
            return 1.0
        return self.block_hit_ratio[policy] / self.opt_hit_ratio


@dataclass(slots=True, frozen=True)
class PolicySummary:
    """A policy over the whole family: geometric mean and worst fraction of OPT, and its worst
    margin against LRU (its fraction minus LRU's, in fractions of OPT; negative: below LRU)."""

    policy: str
    geometric_mean: float
    worst: float
    worst_cell: str
    worst_against_lru: float
    worst_against_lru_cell: str


_worker_traces: dict[str, tuple[list[TraceRequest], int]] = {}


def _worker_init(niceness: int) -> None:
    if niceness:
        os.nice(niceness)


def _member(name: str, trace: Path | None) -> tuple[list[TraceRequest], int]:
    if name not in _worker_traces:
        requests = load_member(name, trace)
        _worker_traces[name] = (requests, count_distinct_pages(requests))
    return _worker_traces[name]


def _run_job(job: tuple[str, str, str | None, Path | None]) -> tuple[str, str, str | None,
                                                                      int, float, float]:
    # A job is one replay (policy) or one OPT (None) of one trace at one capacity.
    name, capacity, policy, trace = job
    requests, num_distinct = _member(name, trace)
    pages = max(1, parse_capacity(capacity, num_distinct, 1))
    if policy is None:
        ratio = opt_hit_ratio(requests, pages)
        return name, capacity, None, pages, ratio, ratio
    result = replay(requests, ReplayConfig(pages, policy))
    return name, capacity, policy, pages, result.block_hit_ratio, result.prefix_hit_ratio


def evaluate(policies: Sequence[str], members: Sequence[str], capacities: Sequence[str], *,
             trace: Path | None = None, num_workers: int = 2, niceness: int = 10,
             on_done: Callable[[], None] | None = None) -> list[FamilyCell]:
    """Replay every policy (and OPT) on every member at every capacity; cells in member order.

    Jobs are grouped by member so each worker reads or generates a trace once; `on_done` is
    called after each job (for progress).
    """
    cells = {(name, capacity): FamilyCell(name, capacity, 0)
             for name in members for capacity in capacities}
    jobs = [(name, capacity, policy, trace) for name in members for capacity in capacities
            for policy in (None, *policies)]
    with ProcessPoolExecutor(max(1, num_workers), initializer=_worker_init,
                             initargs=(niceness,)) as pool:
        for name, capacity, policy, pages, block, prefix in pool.map(_run_job, jobs):
            cell = cells[name, capacity]
            cell.capacity_pages = pages
            if policy is None:
                cell.opt_hit_ratio = block
            else:
                cell.block_hit_ratio[policy] = block
                cell.prefix_hit_ratio[policy] = prefix
            if on_done is not None:
                on_done()
    return list(cells.values())


def summarize(cells: Sequence[FamilyCell], policies: Sequence[str]) -> list[PolicySummary]:
    """Each policy's geometric mean and worst case over `cells`, and its worst margin against
    LRU (0 when LRU was not replayed)."""
    summaries = []
    for policy in policies:
        fractions = [(cell.opt_fraction(policy), f"{cell.trace} @ {cell.capacity}")
                     for cell in cells]
        log_sum = sum(math.log(max(fraction, 1e-9)) for fraction, _ in fractions)
        worst = min(fractions)
        margins = [(cell.opt_fraction(policy) - cell.opt_fraction(BASELINE_POLICY),
                    f"{cell.trace} @ {cell.capacity}")
                   for cell in cells if BASELINE_POLICY in cell.block_hit_ratio]
        worst_margin = min(margins) if margins else (0.0, "")
        summaries.append(PolicySummary(policy, math.exp(log_sum / max(1, len(fractions))),
                                       worst[0], worst[1], worst_margin[0], worst_margin[1]))
    return summaries
