"""Keys and namespaces: chained prefix keys, key validation, namespace fingerprints."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from kvtier.errors import ProtocolError
from kvtier.keys import KEY_BYTES, Namespace, check_keys, prefix_keys

NAMESPACE_ARGS = dict(model_id="m", dtype="bfloat16", layout="page-first", page_tokens=4,
                      page_bytes=4096, tp_rank=0, tp_world_size=2)


def tokens(num_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 200_000, num_tokens, dtype=np.int64)


def test_prefix_keys_are_the_same_in_another_process() -> None:
    ns = Namespace(**NAMESPACE_ARGS)
    token_ids = [int(t) for t in tokens(4 * 5 + 2, seed=7)]
    here = [key.hex() for key in prefix_keys(ns, token_ids)]
    code = (
        "from kvtier.keys import Namespace, prefix_keys\n"
        f"ns = Namespace(**{NAMESPACE_ARGS!r})\n"
        f"print(' '.join(k.hex() for k in prefix_keys(ns, {token_ids!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""})
    assert result.stdout.split() == here
    assert len(here) == 5


def test_keys_are_16_bytes_and_distinct_per_page() -> None:
    ns = Namespace(**NAMESPACE_ARGS)
    keys = prefix_keys(ns, np.zeros(4 * 8, dtype=np.int64))
    assert len(keys) == 8
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    # Same tokens in every page, still distinct keys: each key names its whole prefix.
    assert len(set(keys)) == 8


def test_longer_prompt_extends_the_keys_of_its_prefix() -> None:
    ns = Namespace(**NAMESPACE_ARGS)
    prompt = tokens(40, seed=1)
    assert prefix_keys(ns, prompt[:20]) == prefix_keys(ns, prompt)[:5]
    assert prefix_keys(ns, list(prompt[:12])) == prefix_keys(ns, prompt)[:3]


def test_partial_trailing_page_has_no_key() -> None:
    ns = Namespace(**NAMESPACE_ARGS)
    prompt = tokens(11, seed=2)
    assert len(prefix_keys(ns, prompt)) == 2
    assert prefix_keys(ns, prompt) == prefix_keys(ns, prompt[:8])
    assert prefix_keys(ns, prompt[:3]) == []
    assert prefix_keys(ns, []) == []


def test_other_namespace_gives_other_keys() -> None:
    prompt = tokens(16, seed=3)
    base = prefix_keys(Namespace(**NAMESPACE_ARGS), prompt)
    other = prefix_keys(Namespace(**{**NAMESPACE_ARGS, "tp_rank": 1}), prompt)
    assert set(base).isdisjoint(other)


@pytest.mark.parametrize("changed_page", [0, 2, 4])
def test_changing_one_token_changes_keys_from_its_page_on(changed_page: int) -> None:
    ns = Namespace(**NAMESPACE_ARGS)
    prompt = tokens(20, seed=4)
    changed = prompt.copy()
    changed[changed_page * 4 + 1] += 1
    before, after = prefix_keys(ns, prompt), prefix_keys(ns, changed)
    assert before[:changed_page] == after[:changed_page]
    assert all(b != a for b, a in zip(before[changed_page:], after[changed_page:], strict=True))


def test_parent_key_continues_the_chain() -> None:
    ns = Namespace(**NAMESPACE_ARGS)
    prompt = tokens(28, seed=5)
    one_shot = prefix_keys(ns, prompt)
    head = prefix_keys(ns, prompt[:12])
    tail = prefix_keys(ns, prompt[12:], parent_key=head[-1])
    assert head + tail == one_shot
    # Without the parent, the tail's keys name a different (shorter) prefix.
    assert set(prefix_keys(ns, prompt[12:])).isdisjoint(one_shot)


def test_token_dtype_does_not_change_keys() -> None:
    ns = Namespace(**NAMESPACE_ARGS)
    prompt = tokens(12, seed=6) % 30_000
    assert (prefix_keys(ns, prompt.astype(np.int32)) == prefix_keys(ns, prompt)
            == prefix_keys(ns, [int(t) for t in prompt]))


def test_check_keys_accepts_16_byte_keys() -> None:
    keys = [bytes(16), b"\xff" * 16]
    assert check_keys(iter(keys)) == keys
    assert check_keys([]) == []


@pytest.mark.parametrize("bad, shown", [
    (b"\x00" * 15, "15 bytes"),
    (b"\x00" * 17, "17 bytes"),
    (b"", "0 bytes"),
    (bytearray(16), "bytearray"),
    ("x" * 16, "str"),
    (None, "NoneType"),
    (memoryview(bytes(16)), "memoryview"),
])
def test_check_keys_names_the_bad_key(bad: object, shown: str) -> None:
    with pytest.raises(ProtocolError, match=rf"key #2 must be 16 bytes, got {shown}"):
        check_keys([bytes(16), bytes(16), bad, bytes(16)])


@pytest.mark.parametrize("field, value, message", [
    ("model_id", "", "model_id must not be empty"),
    ("page_tokens", 0, "page_tokens must be at least 1"),
    ("page_bytes", 0, "page_bytes must be at least 1"),
    ("page_bytes", -4096, "page_bytes must be at least 1"),
    ("tp_rank", 2, "tp_rank 2 is outside tp_world_size 2"),
    ("tp_rank", -1, "tp_rank -1 is outside"),
    ("tp_world_size", 0, "tp_rank 0 is outside tp_world_size 0"),
])
def test_namespace_validation(field: str, value: object, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        Namespace(**{**NAMESPACE_ARGS, field: value})


def test_fingerprint_is_stable_and_hex() -> None:
    first, second = Namespace(**NAMESPACE_ARGS), Namespace(**NAMESPACE_ARGS)
    assert first.fingerprint == second.fingerprint
    assert len(first.fingerprint) == 16
    assert first.fingerprint_hex == first.fingerprint.hex()
    assert first == second and hash(first) == hash(second)


def test_fingerprint_is_the_same_in_another_process() -> None:
    code = (
        "from kvtier.keys import Namespace\n"
        f"print(Namespace(**{NAMESPACE_ARGS!r}).fingerprint_hex)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == Namespace(**NAMESPACE_ARGS).fingerprint_hex


@pytest.mark.parametrize("field, value", [
    ("model_id", "m2"), ("dtype", "float16"), ("layout", "vllm-flash"), ("page_tokens", 8),
    ("page_bytes", 8192), ("tp_rank", 1), ("tp_world_size", 4),
])
def test_fingerprint_differs_per_field(field: str, value: object) -> None:
    base = Namespace(**NAMESPACE_ARGS)
    other = Namespace(**{**NAMESPACE_ARGS, field: value})
    assert other.fingerprint != base.fingerprint


def test_fingerprint_is_not_a_field_of_equality_or_init() -> None:
    names = {f.name: f for f in dataclasses.fields(Namespace)}
    assert names["fingerprint"].init is False and names["fingerprint"].compare is False


def test_fingerprint_is_injective_over_string_fields() -> None:
    first = Namespace(**{**NAMESPACE_ARGS, "model_id": "m\x1fbf16", "dtype": "",
                         "layout": "page-first"})
    second = Namespace(**{**NAMESPACE_ARGS, "model_id": "m", "dtype": "bf16",
                          "layout": "\x1fpage-first"})
    assert first != second
    assert first.fingerprint != second.fingerprint
