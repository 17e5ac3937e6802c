"""Trace replay: reading traces, capacities, exact hit counts, OPT as a bound, the CLI, and the
issue's targets on the full Mooncake conversation trace (Mooncake, FAST'25)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli.main import main
from kvtier.config import DEFAULT_HOST_POLICY
from kvtier.errors import ConfigError, TraceError
from kvtier.policies import POLICY_NAMES
from kvtier.replay.belady import opt_hits
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

# Shipped in the repository (traces/README.md says where it comes from): no test skips for it.
TRACE = Path(__file__).resolve().parents[2] / "traces" / "mooncake_conversation_trace.jsonl"
# The daemon's default host policy (DEFAULT_HOST_POLICY) must strand no page; the best online
# policy must beat LRU.
BEST_POLICY = "prefix"


def write_trace(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def one_page_tokens_request(*hash_ids: int, full: int | None = None) -> TraceRequest:
    """A request of pages of one token; `full` of them are full (default all)."""
    return TraceRequest(0, len(hash_ids) if full is None else full, 1, tuple(hash_ids))


@pytest.fixture(scope="module")
def trace_requests() -> list[TraceRequest]:
    return read_trace(TRACE)


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"hash_ids": [1]}', "missing field input_length"),
    ('{"input_length": 5, "hash_ids": [1, -2]}', "hash_ids must be a list of non-negative"),
    ('{"input_length": 5, "hash_ids": "12"}', "hash_ids must be a list of non-negative"),
    ('{"input_length": -5, "hash_ids": [1]}', "must be non-negative integers"),
])
def test_a_bad_line_is_reported_with_its_number(tmp_path: Path, line: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}'
    path = write_trace(tmp_path / "t.jsonl", [good, "", line])
    with pytest.raises(TraceError) as excinfo:
        read_trace(path)
    assert f"{path}:3: " in str(excinfo.value)  # the blank line still counts
    assert message in str(excinfo.value)


def test_a_missing_trace_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")


def test_a_trace_reads_into_requests(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        '{"timestamp": 5, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}',
        '{"input_length": 512, "hash_ids": [0]}',
    ])
    first, second = read_trace(path)
    assert first == TraceRequest(5, 1100, 3, (0, 1, 2))
    assert first.num_full_pages(512) == 2  # the third page is partly filled
    assert second == TraceRequest(0, 512, 0, (0,))
    assert count_distinct_pages([first, second]) == 3


@pytest.mark.parametrize(("text", "pages"), [
    ("9140", 9140),
    ("5%", 9140),  # 9139.5 rounds up, as the traces' README counts
    ("1%", 1828),
    ("0%", 0),
    ("64GiB", 64 * 1024 // 2),
    (" 3MiB ", 1),
])
def test_capacities_in_pages_shares_and_bytes(text: str, pages: int) -> None:
    assert parse_capacity(text, 182_790, 2 << 20) == pages


@pytest.mark.parametrize("text", ["five%", "101%", "lots"])
def test_a_bad_capacity_is_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_capacity(text, 100, 1 << 20)


# Host of 3 pages. LRU evicts the pages a request used together deepest first: request 3 evicts
# 2 (not 1, which would strand 2), request 4 hits 1 and stores 2 again under it, evicting 3;
# request 5's last page is partly filled.
TINY = [
    one_page_tokens_request(1, 2),  # store 1, 2
    one_page_tokens_request(3),  # store 3
    one_page_tokens_request(5),  # LRU evicts 2
    one_page_tokens_request(1, 2),  # 1 hits; store 2, evicting 3
    one_page_tokens_request(5, 6, full=1),  # 5 hits; 6 is never stored
    one_page_tokens_request(1, 2),  # 1 and 2 hit
]


def test_lru_exact_block_and_prefix_hits_on_a_tiny_trace() -> None:
    result = replay(TINY, ReplayConfig(host_pages=3, host_policy="lru", page_tokens=1))
    assert (result.num_requests, result.num_references) == (6, 10)
    assert (result.hits, result.prefix_hits) == (4, 4)
    assert (result.block_hit_ratio, result.prefix_hit_ratio) == (0.4, 0.4)
    (host,) = result.tiers
    assert (host.tier, host.hits, host.prefix_hits) == ("host", 4, 4)
    assert result.bytes_written_disk == result.pages_promoted == 0


def test_the_prefix_policy_strands_no_page_on_the_tiny_trace() -> None:
    result = replay(TINY, ReplayConfig(host_pages=3, host_policy="prefix", page_tokens=1))
    assert result.prefix_hits == result.hits


def test_opt_exact_hits() -> None:
    # Capacity 2 over 1 2 3 1 2 3: OPT evicts 2 for 3 (1 returns first), then 1 for 2.
    assert opt_hits([1, 2, 3, 1, 2, 3], [True] * 6, 2) == 2
    assert opt_hits([1, 2, 3, 1, 2, 3], [True] * 6, 3) == 3
    assert opt_hits([1, 2, 1], [True] * 3, 0) == 0
    assert opt_hits([1, 1, 1], [False, True, True], 1) == 1  # the first sight is not stored
    # The same rule through requests: request 5's page 6 is looked up, never stored.
    assert opt_hit_ratio(TINY, 3, page_tokens=1) == pytest.approx(5 / 10)


def test_opt_bounds_every_online_policy_on_a_slice(trace_requests: list[TraceRequest]) -> None:
    requests = trace_requests[:1500]
    capacity = parse_capacity("2%", count_distinct_pages(requests), 1 << 20)
    opt = opt_hit_ratio(requests, capacity)
    for name in POLICY_NAMES:
        result = replay(requests, ReplayConfig(host_pages=capacity, host_policy=name))
        assert 0 < result.block_hit_ratio <= opt, name
        assert result.prefix_hit_ratio <= result.block_hit_ratio


def test_two_tiers_report_their_hits_and_disk_traffic(trace_requests: list[TraceRequest]) -> None:
    requests = trace_requests[:1500]
    num_distinct = count_distinct_pages(requests)
    page_bytes = 1 << 20
    config = ReplayConfig(host_pages=parse_capacity("2%", num_distinct, page_bytes),
                          host_policy=DEFAULT_HOST_POLICY,
                          disk_pages=parse_capacity("10%", num_distinct, page_bytes))
    result = replay(requests, config)
    host, disk = result.tiers
    assert (host.tier, disk.tier) == ("host", "disk")
    assert result.hits == host.hits + disk.hits > 0
    assert disk.hits > 0 and result.pages_demoted > 0 and result.pages_promoted > 0
    assert result.bytes_written_disk >= result.pages_demoted * page_bytes
    assert result.bytes_promoted == result.pages_promoted * page_bytes
    one_tier = replay(requests, ReplayConfig(config.host_pages, DEFAULT_HOST_POLICY))
    assert result.block_hit_ratio > one_tier.block_hit_ratio  # the disk adds hits
    assert result.block_hit_ratio <= opt_hit_ratio(requests, config.host_pages + config.disk_pages)


def test_cli_prints_json_and_draws_a_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    small = write_trace(tmp_path / "small.jsonl", TRACE.read_text().splitlines()[:300])
    plot = tmp_path / "hits.png"
    result = CliRunner().invoke(main, [
        "replay", str(small), "--policy", "host=prefix,disk=lru", "--host-capacity", "5%",
        "--disk-capacity", "20%", "--json", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["host_policy"] == "prefix" and report["disk_policy"] == "lru"
    assert set(report["tiers"]) == {"host", "disk"}
    assert 0 < report["block_hit_ratio"] <= report["opt_block_hit_ratio"]
    assert report["prefix_hit_ratio"] <= report["block_hit_ratio"]
    for tier in report["tiers"].values():
        assert {"block_hit_ratio", "prefix_hit_ratio"} <= set(tier)
    assert plot.stat().st_size > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_names_the_bad_line_of_a_trace(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "bad.jsonl", ['{"input_length": 5, "hash_ids": [1]}', "oops"])
    result = CliRunner().invoke(main, ["replay", str(path)])
    assert result.exit_code != 0
    assert f"{path}:2: not JSON" in result.output


@pytest.mark.parametrize("share", ["1%", "5%"])
@pytest.mark.parametrize("policy", [DEFAULT_HOST_POLICY, BEST_POLICY])
def test_full_trace_strands_no_page(trace_requests: list[TraceRequest], policy: str,
                                    share: str) -> None:
    """Every hit of the default and the best policy is within its request's leading run."""
    host_pages = parse_capacity(share, count_distinct_pages(trace_requests), 1 << 20)
    result = replay(trace_requests, ReplayConfig(host_pages, policy))
    assert result.prefix_hits == result.hits > 0


@pytest.mark.parametrize("policy", [DEFAULT_HOST_POLICY, BEST_POLICY])
def test_full_trace_two_tiers_target(trace_requests: list[TraceRequest], policy: str) -> None:
    """Host 5% over disk 25% hits at least 0.8 of OPT for the combined capacity, and no page is
    stranded across the two tiers."""
    num_distinct = count_distinct_pages(trace_requests)
    host_pages = parse_capacity("5%", num_distinct, 1 << 20)
    disk_pages = parse_capacity("25%", num_distinct, 1 << 20)
    two_tiers = replay(trace_requests, ReplayConfig(host_pages, policy, disk_pages=disk_pages))
    assert two_tiers.prefix_hits == two_tiers.hits
    assert two_tiers.block_hit_ratio >= 0.8 * opt_hit_ratio(trace_requests,
                                                             host_pages + disk_pages)


def test_full_trace_default_policy_reaches_its_five_percent_target(
        trace_requests: list[TraceRequest]) -> None:
    """The daemon's default host policy hits at least 0.60 of OPT at a host of 5% (#18)."""
    host_pages = parse_capacity("5%", count_distinct_pages(trace_requests), 1 << 20)
    default = replay(trace_requests, ReplayConfig(host_pages, DEFAULT_HOST_POLICY))
    assert default.block_hit_ratio >= 0.60 * opt_hit_ratio(trace_requests, host_pages)


def test_full_trace_best_policy_reaches_its_five_percent_target(
        trace_requests: list[TraceRequest]) -> None:
    """The best online policy hits at least 0.62 of OPT at a host of 5% of the distinct pages."""
    host_pages = parse_capacity("5%", count_distinct_pages(trace_requests), 1 << 20)
    best = replay(trace_requests, ReplayConfig(host_pages, BEST_POLICY))
    assert best.block_hit_ratio >= 0.62 * opt_hit_ratio(trace_requests, host_pages)


# The synthetic trace family: quick conversations, slow ones, and document-heavy traffic.
SYNTHETIC_PRESETS = {
    "conversations": {},
    "slow conversations": dict(seed=1, think_requests=2000.0, continue_probability=0.35,
                               think_sigma=1.5),
    "shared documents": dict(seed=2, document_share=0.7, num_documents=100,
                             continue_probability=0.3, think_requests=1500.0, think_sigma=1.5),
}


def test_synthetic_conversations_are_seeded_and_chained() -> None:
    requests = synthetic_conversations(2000, seed=5)
    assert requests == synthetic_conversations(2000, seed=5)
    assert requests != synthetic_conversations(2000, seed=6)
    parent_of: dict[int, int | None] = {}
    num_sharing_past_prompts = 0  # continued turns and shared documents
    for request in requests:
        full = request.num_full_pages(512)
        assert full == len(request.hash_ids) - 1  # then one partly filled page
        num_sharing_past_prompts += any(p in parent_of for p in request.hash_ids[4:])
        for index, page in enumerate(request.hash_ids):
            parent = request.hash_ids[index - 1] if index else None
            assert parent_of.setdefault(page, parent) == parent  # one id, one prefix
    assert num_sharing_past_prompts > len(requests) / 4


@pytest.mark.parametrize("preset", SYNTHETIC_PRESETS)
def test_on_synthetic_traces_the_best_policy_beats_lru_and_none_strands(preset: str) -> None:
    requests = synthetic_conversations(2500, **SYNTHETIC_PRESETS[preset])
    capacity = parse_capacity("2%", count_distinct_pages(requests), 1 << 20)
    # Each policy replayed once, the default too when it is one of the others.
    by_policy = {policy: replay(requests, ReplayConfig(capacity, policy))
                 for policy in dict.fromkeys(("lru", BEST_POLICY, DEFAULT_HOST_POLICY))}
    for result in by_policy.values():
        assert result.prefix_hit_ratio == result.block_hit_ratio
    assert (by_policy["lru"].block_hit_ratio <= by_policy[BEST_POLICY].block_hit_ratio
            <= opt_hit_ratio(requests, capacity))


def test_the_shipped_trace_is_the_one_its_readme_describes(
        trace_requests: list[TraceRequest]) -> None:
    assert len(trace_requests) == 12_031
    assert sum(len(r.hash_ids) for r in trace_requests) == 288_500
    assert count_distinct_pages(trace_requests) == 182_790
    readme = (TRACE.parent / "README.md").read_text()
    assert "12,031 requests, 288,500 page references" in readme and "182,790 distinct" in readme
    licence = (TRACE.parent / "LICENSE-Mooncake-Apache-2.0.txt").read_text()
    assert "Apache License" in licence[:200] and "Version 2.0" in licence[:300]
