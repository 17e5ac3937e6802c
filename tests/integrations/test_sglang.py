"""kvtier as SGLang's HiCache L3 storage, through SGLang's real `HiCacheController`, on CPU.

SGLang runs from its own virtual environment (`.ci/install-sglang` makes `.venv-sglang`), so each
SGLang rank here is a `python -m kvtier.integrations.sglang.driver` process in it: SGLang's
device and host pools on CPU tensors, its controller and threads, its backend loader reading
kvtier's dynamic-backend config, and its plugin loader running kvtier's entry point (which puts
the host pool in a sealed memfd). A real daemon serves them. Missing that environment skips the
module, unless KVTIER_REQUIRE_SGLANG=1 (CI).
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.integrations.sglang.driver_process import RankProcess
from kvtier.testing import daemon as harness

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = Path(os.environ.get("KVTIER_SGLANG_PYTHON",
                                    REPO / ".venv-sglang" / "bin" / "python"))
PAGE_TOKENS = 16
SUPPORTED_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]

if not SGLANG_PYTHON.exists():
    if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"KVTIER_REQUIRE_SGLANG=1 but there is no SGLang environment at "
                           f"{SGLANG_PYTHON}: run `bash .ci/install-sglang`")
    pytest.skip(f"no SGLang environment at {SGLANG_PYTHON} (bash .ci/install-sglang makes one)",
                allow_module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RankProcess]]:
    """`ranks(*args)`: a started SGLang rank (not yet ready), closed at the module's end."""
    started: list[RankProcess] = []
    workdir = tmp_path_factory.mktemp("sglang")

    def start(*args: str) -> RankProcess:
        rank = RankProcess(SGLANG_PYTHON, list(args), workdir)
        started.append(rank)
        return rank

    yield start
    for rank in started:
        assert rank.close() == 0, rank.log()


@pytest.fixture(scope="module")
def engine(ranks: Callable[..., RankProcess]) -> RankProcess:
    """One SGLang rank (TP 1) that the tests reopen against their own daemon."""
    return ranks().wait_ready()


@pytest.fixture
def daemon(make_daemon, socket_dir: Path, tmp_path: Path):
    return make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--write-policy",
                       "write-through")


def assert_clean(rank: RankProcess) -> None:
    """No exception reached SGLang's threads and none was logged at ERROR."""
    stats = rank.call("stats")
    assert stats["thread_deaths"] == [] and stats["errors"] == [], rank.log()


def test_the_host_pool_is_a_sealed_memfd_with_no_name_in_dev_shm(engine, daemon) -> None:
    """The daemon maps the pool it was handed as a descriptor; no other process can open it by
    name, and a killed engine leaves nothing behind (before: /dev/shm/kvtier-pool-*)."""
    opened = engine.call("open", backend="kvtier", layout="layer_first",
                         socket=str(daemon.socket_path))
    assert opened["zero_copy"], engine.log()
    assert engine.call("backup", seed=99, num_pages=2)["completed_tokens"] == 2 * PAGE_TOKENS
    assert engine.call("prefetch", seed=99, num_pages=2)["hit_tokens"] == 2 * PAGE_TOKENS
    assert list(Path("/dev/shm").glob(f"kvtier-pool-{engine.process.pid}-*")) == []
    with daemon.client() as client:
        assert client.check(verify_bytes=True) == []
    assert_clean(engine)


def test_every_supported_layout_round_trips_through_the_controller(engine, daemon) -> None:
    for index, layout in enumerate(SUPPORTED_LAYOUTS):
        opened = engine.call("open", backend="kvtier", layout=layout,
                             socket=str(daemon.socket_path))
        assert opened == {"backend": "KvtierHiCacheStorage", "zero_copy": True}, engine.log()
        assert engine.call("prefetch", seed=index, num_pages=6)["hit_tokens"] == 0
        assert engine.call("backup", seed=index, num_pages=6)["completed_tokens"] == 96
        got = engine.call("prefetch", seed=index, num_pages=6)
        assert got == {**got, "hit_tokens": 96, "completed_tokens": 96, "identical": True}, layout
        # A longer prompt with the same start: its first 6 pages hit, the rest miss.
        longer = engine.call("prefetch", seed=index, num_pages=9)
        assert (longer["hit_tokens"], longer["identical"]) == (96, True), layout
        stats = engine.call("stats")
        assert stats["backup_pgs"] == [6] and stats["prefetch_pgs"] == [6, 6], layout
    with daemon.client() as client:
        clients = client.stats()["clients"]
        sglang = [c for c in clients if c["name"].startswith("sglang-tp0-")]
        assert [c["pools"] for c in sglang] == [1], clients  # its host pool, registered
        harness.assert_sound(client)
    assert_clean(engine)


def test_a_layout_kvtier_cannot_describe_is_refused_at_attach(engine, daemon) -> None:
    refused = engine.call("open", backend="kvtier", layout="page_unified",
                          socket=str(daemon.socket_path))
    assert "does not support --hicache-mem-layout page_unified" in refused["error"]


def test_what_one_process_backed_up_another_prefetches(engine, ranks, daemon) -> None:
    other = ranks().wait_ready()
    for rank in (engine, other):
        assert rank.call("open", backend="kvtier", layout="page_first",
                         socket=str(daemon.socket_path))["zero_copy"]
    assert engine.call("backup", seed=20, num_pages=8)["completed_tokens"] == 8 * PAGE_TOKENS
    got = other.call("prefetch", seed=20, num_pages=8)
    assert (got["completed_tokens"], got["identical"]) == (8 * PAGE_TOKENS, True), other.log()
    assert other.close() == 0, other.log()
    assert_clean(engine)


def test_a_daemon_killed_during_a_prefetch_gives_misses_then_a_new_one_hits(
        engine, make_daemon, socket_dir: Path, tmp_path: Path) -> None:
    sock, disk = socket_dir / "k.sock", tmp_path / "disk"
    daemon = make_daemon(sock, disk, "--write-policy", "write-through")
    engine.call("open", backend="kvtier", layout="page_first", socket=str(sock))
    assert engine.call("backup", seed=30, num_pages=4)["completed_tokens"] == 64
    with daemon.client() as client:
        harness.wait_until(lambda: client.stats()["tiers"][1]["num_pages"] >= 4,
                           "the pages written through to disk")
    engine.send("prefetch", seed=30, num_pages=4, pause=True)
    assert engine.reply() == "PAUSED"  # SGLang found 4 pages; the transfer has not started
    os.kill(daemon.process.pid, signal.SIGKILL)
    daemon.wait_exit()
    engine.send("go")
    missed = engine.reply()
    assert (missed["hit_tokens"], missed["completed_tokens"]) == (64, 0), engine.log()
    assert engine.call("prefetch", seed=30, num_pages=4)["hit_tokens"] == 0  # no daemon: a miss
    make_daemon(sock, disk, "--write-policy", "write-through")
    harness.wait_until(lambda: engine.call("prefetch", seed=30, num_pages=4)["identical"],
                       "a hit from the new daemon", timeout_s=60)
    assert_clean(engine)


def test_pages_gone_between_the_hit_query_and_the_transfer_are_misses(engine, daemon) -> None:
    sock = str(daemon.socket_path)
    engine.call("open", backend="kvtier", layout="layer_first", socket=sock)
    assert engine.call("backup", seed=35, num_pages=4)["completed_tokens"] == 64
    got = engine.call("prefetch", seed=35, num_pages=4, forget_pages=[2], socket=sock)
    # SGLang found 4 pages; the third was deleted before its transfer: the leading 2 count.
    assert (got["hit_tokens"], got["completed_tokens"], got["identical"]) == (64, 32, True)
    assert_clean(engine)


def test_sglang_fault_injection_gives_misses_never_wrong_bytes(engine, daemon) -> None:
    engine.call("open", backend="kvtier", layout="page_head", socket=str(daemon.socket_path),
                fault_failure=0.3, fault_delay_s=0.01)
    outcomes = []
    for seed in range(40, 52):
        engine.call("backup", seed=seed, num_pages=3)
        got = engine.call("prefetch", seed=seed, num_pages=3)
        assert got["completed_tokens"] <= got["hit_tokens"]
        assert got["identical"] in (None, True), got
        outcomes.append(got["completed_tokens"])
    assert_clean(engine)
    engine.call("open", backend="kvtier", layout="page_head", socket=str(daemon.socket_path))
    for seed in range(40, 52):  # what was kept despite the faults is served whole
        engine.call("backup", seed=seed, num_pages=3)
        got = engine.call("prefetch", seed=seed, num_pages=3)
        assert (got["completed_tokens"], got["identical"]) == (48, True), got
    assert_clean(engine)


def test_tensor_parallel_ranks_agree_on_the_smallest_hit_of_their_own_pages(
        ranks, daemon) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    world = [ranks("--tp-rank", str(r), "--tp-size", "2", "--dist-port", port) for r in (0, 1)]
    for rank in world:
        rank.wait_ready()

    def both(verb: str, *per_rank: dict) -> list:
        for rank, params in zip(world, per_rank):
            rank.send(verb, **params)
        return [rank.reply() for rank in world]

    opened = dict(backend="kvtier", layout="page_first", socket=str(daemon.socket_path))
    assert [r["zero_copy"] for r in both("open", opened, opened)] == [True, True]
    # Rank 0 keeps 5 pages of the prompt, rank 1 only 2: SGLang takes the minimum, 2 pages,
    # and each rank gets back its own bytes (its shard), not the other's.
    assert [r["completed_tokens"] for r in both("backup", dict(seed=60, num_pages=5),
                                                dict(seed=60, num_pages=2))] == [80, 32]
    asked = dict(seed=60, num_pages=5)
    got = both("prefetch", asked, asked)
    assert [(r["hit_tokens"], r["completed_tokens"], r["identical"]) for r in got] == \
        [(32, 32, True)] * 2, world[0].log() + world[1].log()
    for rank in world:
        assert_clean(rank)
    with daemon.client() as client:
        assert client.stats()["num_namespaces"] == 2


PLUGIN_CHECK = """
import json, sglang.srt.runtime_context as context
from types import SimpleNamespace
from sglang.srt.plugins import load_plugins
from sglang.srt.mem_cache.pool_host import base, mha
from kvtier.integrations.sglang.plugin import KvtierHostAllocator
load_plugins()  # finds kvtier's entry point, as every SGLang process does at start
kinds = []
for module_path in ("kvtier.integrations.sglang", "someone.else"):
    extra = json.dumps({"module_path": module_path, "interface_v1": 1})
    context.get_memory = lambda: SimpleNamespace(hicache_storage_backend_extra_config=extra)
    kinds.append([isinstance(m.get_allocator_from_storage(kind), KvtierHostAllocator)
                  for m in (base, mha) for kind in ("dynamic", "file")])
print(json.dumps(kinds))
"""


def test_sglangs_plugin_loader_makes_kvtier_configured_host_pools_shared(tmp_path: Path) -> None:
    import json
    import subprocess

    done = subprocess.run([str(SGLANG_PYTHON), "-c", PLUGIN_CHECK], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # The dynamic backend configured as kvtier gets kvtier's allocator; nothing else does.
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[True, False, True, False],
                                                                 [False, False, False, False]]
