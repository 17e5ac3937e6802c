"""What a better prediction of returns would buy the prefix policy, and what a trace offers.

Run:

    python bench/bench_policy_headroom.py [TRACE] [--capacity 1%] [--json]

TRACE defaults to the Mooncake conversation trace shipped in traces/. At one host capacity
(`--capacity`, as `kvtier replay --host-capacity` reads it), through the same replay code path:

- LRU, the prefix policy and Belady's OPT: the block hit ratios of `kvtier replay`.
- The prefix policy told one more bit at each reference: whether the page comes back within its
  history's horizon (HISTORY_FACTOR capacities of references, the horizon it measures returns
  over). The bit is the truth with probability q, else a seeded coin flip (so it is right with
  probability (1 + q) / 2); it splits each class of the policy's statistics in two, so the
  policy learns what the bit is worth exactly as it learns from a page's use count and depth.
- Information: the bits per reference that each feature an online policy could read (about the
  page, its request and its conversation) tells about that same event beyond the policy's class
  (use count, depth octave), beside the bits the oracle's bit tells at each q and the
  uncertainty the class leaves. Output length is known only once a request is decoded, after its
  pages are stored: it is listed for comparison, marked after the fact.

Prints one table of hit ratios and one of information; `--json` prints one JSON object instead.
Deterministic (seeded); about a minute at 1% on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import kvtier.store.placement
from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES
from kvtier.policies import EvictionPolicy, PrefixPolicy
from kvtier.policies.prefix import HISTORY_FACTOR
from kvtier.policies.reuse import ReuseHistory, page_class
from kvtier.replay.replayer import (
    DEFAULT_PAGE_TOKENS,
    ReplayConfig,
    TraceRequest,
    count_distinct_pages,
    opt_hit_ratio,
    parse_capacity,
    read_trace,
    replay,
)

DEFAULT_TRACE = (Path(__file__).resolve().parents[1] / "traces"
                 / "mooncake_conversation_trace.jsonl")
ORACLE_ACCURACIES = (1.0, 0.9, 0.8, 0.6)  # q: the share of references told the truth
SEED = 1


@dataclass(slots=True)
class ReturnOracle:
    """Whether each full-page reference of the trace comes back within the horizon, served
    request by request as the replay reaches them: the truth with probability `accuracy`, else
    a coin flip."""

    comes_back_by_request: list[dict[int, bool]]
    accuracy: float
    rng: random.Random
    request_index: int = 0

    def tell(self, key: bytes) -> int:
        truth = self.comes_back_by_request[self.request_index].get(
            int.from_bytes(key[-KEY_BYTES:], "big"), False)
        if self.rng.random() < self.accuracy:
            return int(truth)
        return self.rng.randrange(2)


def oracle_policy_type(oracle: ReturnOracle) -> type[PrefixPolicy]:
    """The prefix policy whose classes carry the oracle's bit beside the depth octave."""
    depth_shapes = ReuseHistory.num_shapes

    class OracleHistory(ReuseHistory):
        num_shapes = 2 * depth_shapes

        def shape(self, key: bytes, depth: int) -> int:
            return super().shape(key, depth) + depth_shapes * oracle.tell(key)

    class OraclePrefixPolicy(PrefixPolicy):
        history_type = OracleHistory

    return OraclePrefixPolicy


@contextmanager
def prefix_policy_replaced(policy_type: type[PrefixPolicy]) -> Iterator[None]:
    # The replay builds its tiers' policies by name: "prefix" builds `policy_type` meanwhile.
    make_policy = kvtier.store.placement.make_policy

    def make(name: str, capacity_pages: int) -> EvictionPolicy:
        return policy_type(capacity_pages) if name == "prefix" else make_policy(name,
                                                                                capacity_pages)
    kvtier.store.placement.make_policy = make
    try:
        yield
    finally:
        kvtier.store.placement.make_policy = make_policy


@dataclass(slots=True)
class References:
    """The trace's full-page references (the ones the policy sees), in order, with whether each
    comes back within the horizon, the policy's class and the features of each."""

    comes_back: np.ndarray
    page_class: np.ndarray
    feature_to_values: dict[str, np.ndarray]
    comes_back_by_request: list[dict[int, bool]]


AFTER_THE_FACT = ", after the fact"
FEATURE_NAMES = (
    "pages the request brings new (octave)",
    "share of the request seen before (quarters)",
    "request length (octave)",
    "pages after this one in the request (octave)",
    "the page's last reuse gap (octave)",
    "references since the conversation's last turn (octave)",
    "seconds since the conversation's last turn (octave)",
    "conversation turn",
    "pages after the parent so far",
    "output length (octave)" + AFTER_THE_FACT,
)


def octave(count: int) -> int:
    return count.bit_length()


def collect_references(requests: Sequence[TraceRequest], horizon: int) -> References:
    """Walk the trace once: per full-page reference, its label, class and features."""
    pages = [request.hash_ids[:request.num_full_pages(DEFAULT_PAGE_TOKENS)]
             for request in requests]
    sequence = [page for request_pages in pages for page in request_pages]
    next_use = np.full(len(sequence), np.iinfo(np.int64).max, dtype=np.int64)
    last_seen: dict[int, int] = {}
    for position in range(len(sequence) - 1, -1, -1):
        next_use[position] = last_seen.get(sequence[position], next_use[position])
        last_seen[sequence[position]] = position
    comes_back = next_use - np.arange(len(sequence)) < horizon

    features: dict[str, list[int]] = {name: [] for name in FEATURE_NAMES}
    classes: list[int] = []
    comes_back_by_request: list[dict[int, bool]] = []
    page_to_uses: dict[int, int] = {}
    page_to_last: dict[int, tuple[int, int]] = {}  # (reference position, timestamp ms)
    page_to_turn: dict[int, int] = {}
    page_to_children: dict[int, set[int]] = {}
    position = 0
    for request, request_pages in zip(requests, pages):
        seen = 0
        while seen < len(request_pages) and request_pages[seen] in page_to_last:
            seen += 1
        num_new = sum(page not in page_to_last for page in request_pages)
        turn = page_to_turn.get(request_pages[seen - 1], 0) + 1 if seen else 0
        last_turn = page_to_last[request_pages[seen - 1]] if seen else None
        comes_back_by_request.append({})
        for depth, page in enumerate(request_pages):
            uses = page_to_uses.get(page, 0) + 1
            classes.append(page_class(uses, depth))
            last = page_to_last.get(page)
            parent_children = page_to_children.get(request_pages[depth - 1]) if depth else None
            values = (octave(num_new), 4 * seen // len(request_pages),
                      octave(len(request_pages)), octave(len(request_pages) - 1 - depth),
                      octave(position - last[0]) if last else 0,
                      octave(position - last_turn[0]) if last_turn else 0,
                      octave((request.timestamp_ms - last_turn[1]) // 1000) if last_turn else 0,
                      min(turn, 8), min(len(parent_children or ()), 4),
                      octave(request.output_length))
            for name, value in zip(FEATURE_NAMES, values):
                features[name].append(value)
            comes_back_by_request[-1][page] = bool(comes_back[position])
            page_to_uses[page] = uses
            page_to_last[page] = (position, request.timestamp_ms)
            page_to_turn[page] = turn
            if depth:
                page_to_children.setdefault(request_pages[depth - 1], set()).add(page)
            position += 1
    return References(comes_back, np.array(classes),
                      {name: np.array(values) for name, values in features.items()},
                      comes_back_by_request)


def entropy_bits(labels: np.ndarray, groups: np.ndarray) -> float:
    """H(label | group) in bits per reference."""
    _, group_index, counts = np.unique(groups, return_inverse=True, return_counts=True)
    positives = np.bincount(group_index, weights=labels, minlength=counts.size)
    share = positives / counts
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = -(np.nan_to_num(share * np.log2(share))
                 + np.nan_to_num((1 - share) * np.log2(1 - share)))
    return float((bits * counts).sum() / labels.size)


def information(references: References, rng: np.random.Generator) -> dict:
    """Bits per reference each feature, and the oracle's bit, tell beyond the class."""
    labels = references.comes_back.astype(np.float64)
    classes = references.page_class.astype(np.int64)
    left = entropy_bits(labels, classes)

    def gain(values: np.ndarray) -> float:
        return left - entropy_bits(labels, classes * 1024 + values.astype(np.int64))

    oracle_bits = {}
    for accuracy in ORACLE_ACCURACIES:
        coin = rng.integers(0, 2, labels.size)
        told = np.where(rng.random(labels.size) < accuracy, references.comes_back, coin)
        oracle_bits[accuracy] = gain(told)
    online = [values for name, values in references.feature_to_values.items()
              if not name.endswith(AFTER_THE_FACT)]
    return {"uncertainty_bits": left,
            "feature_bits": {name: gain(values)
                             for name, values in references.feature_to_values.items()},
            "joint_online_bits": held_out_gain(labels, classes, online),
            "oracle_bits": oracle_bits}


def held_out_gain(labels: np.ndarray, classes: np.ndarray, features: list[np.ndarray]) -> float:
    """Bits per reference that the features together tell beyond the class, on the trace's
    second half, by a logistic model fitted on its first half against one of the class alone:
    fitted and scored on separate halves, so many features cannot fake information."""
    def one_hot(columns: list[np.ndarray]) -> np.ndarray:
        blocks = [np.eye(int(column.max()) + 1)[column] for column in columns]
        return np.hstack([np.ones((labels.size, 1))] + blocks)

    first = np.arange(labels.size) < labels.size // 2
    scores = []
    for columns in ([classes], [classes] + features):
        inputs = one_hot([column.astype(np.int64) for column in columns])
        weights = fit_logistic(inputs[first], labels[first])
        chance = 1 / (1 + np.exp(-inputs[~first] @ weights))
        chance = np.clip(chance, 1e-9, 1 - 1e-9)
        truth = labels[~first]
        scores.append(-np.mean(truth * np.log2(chance) + (1 - truth) * np.log2(1 - chance)))
    return float(scores[0] - scores[1])


def fit_logistic(inputs: np.ndarray, labels: np.ndarray, steps: int = 30) -> np.ndarray:
    """Newton's method on the log-loss, with a little ridge so empty columns stay at zero."""
    weights = np.zeros(inputs.shape[1])
    ridge = 1e-3 * labels.size * np.eye(inputs.shape[1])
    for _ in range(steps):
        chance = 1 / (1 + np.exp(-inputs @ weights))
        gradient = inputs.T @ (chance - labels) + ridge @ weights
        curvature = (inputs * (chance * (1 - chance))[:, None]).T @ inputs + ridge
        weights -= np.linalg.solve(curvature, gradient)
    return weights


def hit_ratio(requests: Sequence[TraceRequest], capacity_pages: int, policy: str) -> float:
    return replay(requests, ReplayConfig(capacity_pages, policy)).block_hit_ratio


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    requests = read_trace(args.trace)
    capacity_pages = parse_capacity(args.capacity, count_distinct_pages(requests),
                                    ReplayConfig(1).page_bytes)
    horizon = HISTORY_FACTOR * capacity_pages
    log(f"{len(requests)} requests, capacity {capacity_pages} pages, horizon {horizon}")
    references = collect_references(requests, horizon)
    results = {"trace": str(args.trace), "capacity_pages": capacity_pages,
               "horizon_references": horizon,
               "comes_back_share": float(references.comes_back.mean())}
    for policy in ("lru", "prefix"):
        log(f"replay {policy}")
        results[f"{policy}_block_hit_ratio"] = hit_ratio(requests, capacity_pages, policy)
    log("OPT")
    results["opt_block_hit_ratio"] = opt_hit_ratio(requests, capacity_pages)
    results["oracle_block_hit_ratio"] = {}
    for accuracy in ORACLE_ACCURACIES:
        log(f"replay prefix with the oracle's bit right at q = {accuracy}")
        oracle = ReturnOracle(references.comes_back_by_request, accuracy, random.Random(SEED))

        def advance(index: int, oracle: ReturnOracle = oracle) -> None:
            oracle.request_index = index + 1

        with prefix_policy_replaced(oracle_policy_type(oracle)):
            outcome = replay(requests, ReplayConfig(capacity_pages, "prefix"), advance)
        results["oracle_block_hit_ratio"][accuracy] = outcome.block_hit_ratio
    results.update(information(references, np.random.default_rng(SEED)))
    return results


def print_tables(results: dict) -> None:
    lru, opt = results["lru_block_hit_ratio"], results["opt_block_hit_ratio"]
    table = Table(title=f"block hit ratio at {results['capacity_pages']} pages "
                        f"(bit: comes back within {results['horizon_references']} references, "
                        f"{100 * results['comes_back_share']:.1f}% do)")
    for column in ("policy", "block hit %", "x LRU", "of OPT"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    rows = [("LRU", lru), ("prefix", results["prefix_block_hit_ratio"])]
    rows += [(f"prefix + oracle bit, q = {q}", ratio)
             for q, ratio in results["oracle_block_hit_ratio"].items()]
    rows.append(("OPT", opt))
    for label, ratio in rows:
        table.add_row(label, f"{100 * ratio:.2f}", f"{ratio / lru:.2f}", f"{ratio / opt:.3f}")
    console = Console()
    console.print(table)
    left = results["uncertainty_bits"]
    table = Table(title=f"bits per reference about a return, beyond the class "
                        f"(the class leaves {left:.3f})")
    table.add_column("told by")
    table.add_column("bits", justify="right")
    table.add_column("share of what is left", justify="right")
    named = [(f"oracle bit, q = {q}", bits) for q, bits in results["oracle_bits"].items()]
    named.append(("all online features together, held out", results["joint_online_bits"]))
    named += sorted(results["feature_bits"].items(), key=lambda item: -item[1])
    for label, bits in named:
        table.add_row(label, f"{bits:.4f}", f"{100 * bits / left:.1f}%")
    console.print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE,
                        help="Mooncake-format JSONL trace (default: %(default)s)")
    parser.add_argument("--capacity", default="1%",
                        help="host capacity: pages, a share of distinct pages (5%%) or bytes "
                             "(default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    log_console = Console(stderr=True)
    try:
        results = run(args, log_console.log)
    except ConfigError as exc:  # an unreadable trace or a capacity that is not one
        sys.exit(f"bench_policy_headroom: {exc}")
    if args.json:
        print(json.dumps(results))
    else:
        print_tables(results)


if __name__ == "__main__":
    sys.exit(main())
