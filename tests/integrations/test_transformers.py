"""A real (tiny, seeded) Llama reusing prompt-prefix KV through a real daemon process, on the CPU.

Each scenario generates greedily with and without kvtier and asserts the same tokens; the tokens
the model actually prefilled are counted at its embedding layer, never inferred from the report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtier.integrations.transformers import KvtierGenerator  # noqa: E402
from kvtier.keys import prefix_keys  # noqa: E402
from kvtier.testing import daemon as harness  # noqa: E402

PAGE_TOKENS = 16
PREFIX_TOKENS = 128  # 8 shared pages
NEW_TOKENS = 8
PAGE_BYTES = 2 * 2 * PAGE_TOKENS * 2 * 16 * 4  # layers x K,V x tokens x kv heads x dim x float32


@pytest.fixture
def start_daemon(socket_dir: Path, make_daemon: Callable[..., harness.DaemonProcess]
                 ) -> Callable[..., harness.DaemonProcess]:
    """`start_daemon(*flags, env=None)`: a ready daemon (the harness's tiers, then `flags`),
    stopped and checked for a clean exit at teardown."""

    def start(*flags: str, env: dict[str, str] | None = None) -> harness.DaemonProcess:
        return make_daemon(socket_dir / "k.sock", socket_dir / "disk", *flags, env=env)

    return start


@pytest.fixture
def small_host_daemon(start_daemon: Callable[..., harness.DaemonProcess]
                      ) -> harness.DaemonProcess:
    """A write-back daemon whose host tier holds 12 pages: the 13th store demotes to disk."""
    env = {**os.environ, "KVTIER_HOST_CHUNK": str(PAGE_BYTES), "KVTIER_DISK_CHUNK": "1MiB"}
    return start_daemon("--host-capacity", str(12 * PAGE_BYTES), "--disk-capacity", "16MiB",
                        "--write-policy", "write-back", env=env)


class TokenCounter:
    """Counts the tokens of every forward pass at the model's input embedding."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.per_forward: list[int] = []
        model.get_input_embeddings().register_forward_hook(
            lambda module, args, output: self.per_forward.append(args[0].numel()))

    def prefill_tokens_of(self, run: Callable[[], object]) -> int:
        """Tokens in the first forward pass of `run` (its prefill)."""
        self.per_forward.clear()
        run()
        return self.per_forward[0]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                         pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def counter(model: LlamaForCausalLM) -> TokenCounter:
    return TokenCounter(model)


def prompt(seed: int, num_tokens: int, prefix_seed: int | None = 0) -> torch.Tensor:
    """`[1, num_tokens]` ids: a shared 128-token prefix (unless `prefix_seed` is None), then
    seeded tokens of their own."""
    generator = torch.Generator().manual_seed(seed)
    own = torch.randint(1, 256, (num_tokens,), generator=generator)
    if prefix_seed is not None:
        prefix = torch.randint(1, 256, (PREFIX_TOKENS,),
                               generator=torch.Generator().manual_seed(prefix_seed))
        own[:PREFIX_TOKENS] = prefix
    return own.unsqueeze(0)


def greedy(run: Callable[..., object], input_ids: torch.Tensor):
    return run(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False,
               return_dict_in_generate=True, output_logits=True)


def tier_stats(stats: dict, name: str) -> dict:
    return next(tier for tier in stats["tiers"] if tier["tier"] == name)


def assert_same_generation(reference, output) -> None:
    assert torch.equal(output.sequences, reference.sequences)
    torch.testing.assert_close(output.logits[0], reference.logits[0], rtol=1e-5, atol=1e-5)


def test_shared_prefix_is_recalled_not_prefilled(model, counter, start_daemon) -> None:
    daemon = start_daemon("--host-capacity", "64MiB", "--disk-capacity", "64MiB")
    first, second = prompt(1, 165), prompt(2, 157)
    reference_tokens = counter.prefill_tokens_of(lambda: greedy(model.generate, second))
    reference = greedy(model.generate, second)

    with KvtierGenerator(model, daemon.socket_path, page_tokens=PAGE_TOKENS) as kv_model:
        greedy(kv_model.generate, first)
        assert kv_model.last_report.num_reused_tokens == 0
        assert kv_model.last_report.num_stored_pages == 165 // PAGE_TOKENS

        output = None

        def run() -> None:
            nonlocal output
            output = greedy(kv_model.generate, second)

        computed_tokens = counter.prefill_tokens_of(run)
        report = kv_model.last_report
        stats = kv_model.client.stats()
        assert kv_model.client.check(verify_bytes=True) == []

    assert_same_generation(reference, output)
    assert reference_tokens == 157
    assert computed_tokens == 157 - PREFIX_TOKENS
    assert report.num_reused_tokens == PREFIX_TOKENS
    assert report.reused_tiers == ("host",) * (PREFIX_TOKENS // PAGE_TOKENS)
    assert report.num_stored_pages == 1  # the second prompt's own 9th page
    assert stats["counters"]["pages_recalled"] == PREFIX_TOKENS // PAGE_TOKENS
    host = tier_stats(stats, "host")
    assert (host["hits"], host["misses"]) == (8, 10 + 1)  # first prompt: none; second: 8 of 9


def test_whole_prompt_repeat_still_computes_its_last_page(model, counter, start_daemon) -> None:
    daemon = start_daemon("--host-capacity", "64MiB", "--disk-capacity", "64MiB")
    repeated = prompt(3, 160, prefix_seed=None)  # exactly 10 pages
    reference = greedy(model.generate, repeated)

    with KvtierGenerator(model, daemon.socket_path, page_tokens=PAGE_TOKENS) as kv_model:
        greedy(kv_model.generate, repeated)
        output = None

        def run() -> None:
            nonlocal output
            output = greedy(kv_model.generate, repeated)

        computed_tokens = counter.prefill_tokens_of(run)
        assert kv_model.last_report.num_stored_pages == 0

    assert_same_generation(reference, output)
    assert computed_tokens == PAGE_TOKENS  # the last page runs again for the first token's logits


def test_prefix_evicted_to_disk_is_recalled_from_disk(model, counter, small_host_daemon) -> None:
    first, other, second = prompt(1, 165), prompt(9, 197, prefix_seed=None), prompt(2, 157)
    reference = greedy(model.generate, second)

    with KvtierGenerator(model, small_host_daemon.socket_path, page_tokens=PAGE_TOKENS) as kv_model:
        greedy(kv_model.generate, first)
        greedy(kv_model.generate, other)  # 12 pages fill the host: the first prompt's go to disk
        keys = prefix_keys(kv_model.namespace, first[0].numpy())[: PREFIX_TOKENS // PAGE_TOKENS]
        assert kv_model.client.lookup(kv_model.pool_handle, keys).tiers == ["disk"] * len(keys)
        output = None

        def run() -> None:
            nonlocal output
            output = greedy(kv_model.generate, second)

        computed_tokens = counter.prefill_tokens_of(run)
        report = kv_model.last_report
        stats = kv_model.client.stats()
        assert kv_model.client.check(verify_bytes=True) == []

    assert_same_generation(reference, output)
    assert computed_tokens == 157 - PREFIX_TOKENS
    assert report.reused_tiers == ("disk",) * (PREFIX_TOKENS // PAGE_TOKENS)
    assert tier_stats(stats, "disk")["hits"] == 2 * 8  # the test's own lookup, then the model's
    assert stats["counters"]["promotions"] == 8  # a disk hit climbs back to host


def test_corrupt_page_on_disk_falls_back_to_recompute(model, counter, small_host_daemon) -> None:
    first, other, second = prompt(1, 165), prompt(9, 197, prefix_seed=None), prompt(2, 157)
    reference = greedy(model.generate, second)

    with KvtierGenerator(model, small_host_daemon.socket_path, page_tokens=PAGE_TOKENS) as kv_model:
        greedy(kv_model.generate, first)
        greedy(kv_model.generate, other)
        keys = prefix_keys(kv_model.namespace, first[0].numpy())
        slot_file = small_host_daemon.disk_path / "pages.slots"
        header_key_at = slot_file.read_bytes().find(keys[3])  # 48 bytes into the page header
        assert header_key_at >= 0
        with slot_file.open("r+b") as slots:  # in place: the daemon keeps the file open
            slots.seek(header_key_at + 16 + 100)  # a payload byte of page 3
            byte = slots.read(1)[0]
            slots.seek(-1, 1)
            slots.write(bytes([byte ^ 0xFF]))

        output = None

        def run() -> None:
            nonlocal output
            output = greedy(kv_model.generate, second)

        computed_tokens = counter.prefill_tokens_of(run)
        report = kv_model.last_report
        assert kv_model.client.stats()["counters"]["integrity_errors"] == 1
        assert kv_model.client.check(verify_bytes=True) == []
        assert report.num_stored_pages == 2  # the recomputed page 3 and the prompt's own page 8

        again = counter.prefill_tokens_of(lambda: greedy(kv_model.generate, second))

    assert_same_generation(reference, output)
    assert report.num_reused_tokens == 3 * PAGE_TOKENS
    assert computed_tokens == 157 - 3 * PAGE_TOKENS
    assert len(report.recall_problems) == 1 and "page 3" in report.recall_problems[0]
    assert again == 157 - 9 * PAGE_TOKENS  # page 3 is whole again, and page 8 is stored too


def test_missing_page_falls_back_to_recompute(model, counter, start_daemon) -> None:
    daemon = start_daemon("--host-capacity", "64MiB", "--disk-capacity", "64MiB")
    first, second = prompt(1, 165), prompt(2, 157)
    reference = greedy(model.generate, second)

    with KvtierGenerator(model, daemon.socket_path, page_tokens=PAGE_TOKENS) as kv_model:
        greedy(kv_model.generate, first)
        keys = prefix_keys(kv_model.namespace, first[0].numpy())
        assert kv_model.client.delete(kv_model.pool_handle, [keys[2]]) == 1
        output = None

        def run() -> None:
            nonlocal output
            output = greedy(kv_model.generate, second)

        computed_tokens = counter.prefill_tokens_of(run)
        report = kv_model.last_report

    assert_same_generation(reference, output)
    assert report.num_reused_tokens == 2 * PAGE_TOKENS
    assert computed_tokens == 157 - 2 * PAGE_TOKENS
    assert report.num_stored_pages == 2  # the deleted page 2 and the prompt's own page 8


def test_unsupported_requests_are_refused(model, start_daemon) -> None:
    daemon = start_daemon("--host-capacity", "64MiB", "--no-disk")
    with KvtierGenerator(model, daemon.socket_path, page_tokens=PAGE_TOKENS) as kv_model:
        with pytest.raises(ValueError, match="batch size 1"):
            kv_model.generate(torch.cat([prompt(1, 40, None), prompt(2, 40, None)]),
                              max_new_tokens=1)
        with pytest.raises(ValueError, match="beam search"):
            kv_model.generate(prompt(1, 40, None), max_new_tokens=1, num_beams=2)


def test_integrations_package_does_not_import_torch() -> None:
    script = "import sys, kvtier.integrations; assert 'torch' not in sys.modules; print('ok')"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "ok", result.stderr
