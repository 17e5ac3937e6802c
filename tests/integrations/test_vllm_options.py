"""The vLLM connector's parts that need no vLLM: its settings, the page geometry it derives from
vLLM's KV cache config, the check of vLLM's tensors, and its keys.

The configs are plain objects with the fields vLLM 0.32's `KVCacheConfig` has (printed from a
real engine, see tests/integrations/test_vllm.py for the real thing); the tensors are real.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvtier.client.polling import DEFAULT_POLL_US
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.geometry import check_tensors, page_geometry, request_keys
from kvtier.integrations.vllm.options import ConnectorOptions, Park, StoreScope

NUM_BLOCKS, LAYERS, BLOCK, HEADS, HEAD = 8, 2, 32, 2, 32
LAYER_PAGE = BLOCK * HEADS * 2 * HEAD * 4  # float32: K and V of every head and token


def test_defaults_need_no_settings() -> None:
    options = ConnectorOptions.parse(None)
    assert (options.socket, options.load, options.store, options.reconnect_s) == ("", True,
                                                                                   True, 5.0)
    assert ConnectorOptions.parse({"reconnect_s": 1, "store": False}).reconnect_s == 1.0
    assert (options.load_async, options.store_scope, options.store_min_tokens,
            options.skip_stored, options.park, options.recall_gbps) == (
        True, StoreScope.ALL, 0, True, Park.WHILE_OTHERS_RUN, 0.0)
    assert ConnectorOptions.parse({"park": "when_cheaper"}).park is Park.WHEN_CHEAPER
    assert options.poll_us == DEFAULT_POLL_US
    assert ConnectorOptions.parse({"poll_us": 0}).poll_us == 0.0
    chosen = ConnectorOptions.parse({"store_scope": "prompt", "store_min_tokens": 256,
                                     "load_async": False})
    assert (chosen.store_scope, chosen.store_min_tokens, chosen.load_async) == (
        StoreScope.PROMPT, 256, False)


@pytest.mark.parametrize("extra,message", [
    ({"sokcet": "/x"}, "unknown key 'sokcet' for the kvtier connector; known keys: socket"),
    ({"reconnect_s": "soon"}, "reconnect_s must be float, got str 'soon'"),
    ({"store": "yes"}, "store must be bool, got str"),
    ({"load": 1}, "load must be bool, got int"),
    ({"socket": 3}, "socket must be str, got int"),
    ({"timeout_s": True}, "timeout_s must be float, got bool"),
    ({"timeout_s": 0}, "timeout_s must be between 0 and 3600 seconds, got 0.0"),
    ({"store_scope": "decode"}, "store_scope must be one of 'all', 'prompt', got 'decode'"),
    ({"store_min_tokens": 1.5}, "store_min_tokens must be int, got float"),
    ({"store_min_tokens": True}, "store_min_tokens must be int, got bool"),
    ({"store_min_tokens": -1}, "store_min_tokens must be 0 or more, got -1"),
    ({"load_async": "yes"}, "load_async must be bool, got str"),
    ({"park": "never"}, "park must be one of 'while_others_run', 'when_cheaper', got 'never'"),
    ({"recall_gbps": -1}, "recall_gbps must be 0 (measured) or a bandwidth in GB/s, got -1.0"),
    ({"recall_gbps": "fast"}, "recall_gbps must be float, got str 'fast'"),
    ({"poll_us": -1}, "poll_us must be between 0 (never polls) and 10000 microseconds, got -1.0"),
    ({"poll_us": 20_000}, "poll_us must be between 0 (never polls) and 10000 microseconds"),
    ({"poll_us": "off"}, "poll_us must be float, got str 'off'"),
])
def test_a_bad_setting_is_one_sentence_naming_it(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="^kv_connector_extra_config: ") as caught:
        ConnectorOptions.parse(extra)
    assert message in str(caught.value)


def vllm_config(tp_size: int = 1, rank: int = 0, pp_size: int = 1) -> SimpleNamespace:
    hf_config = SimpleNamespace(to_json_string=lambda use_diff: '{"layers": 2}')
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp_size,
                                        tensor_parallel_size=tp_size, rank=rank),
        model_config=SimpleNamespace(model="/models/tiny", hf_config=hf_config, revision=None,
                                     quantization=None, dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        device_config=SimpleNamespace(device_type="cpu"))


def kv_cache_config(layout: str = "LBHNC", spec_name: str = "FullAttentionSpec",
                    dtype: torch.dtype = torch.float32, groups: int = 1,
                    page_size_bytes: int = LAYER_PAGE) -> SimpleNamespace:
    spec_type = type(spec_name, (), {})
    spec = spec_type()
    spec.__dict__.update(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, head_size_v=HEAD,
                         dtype=dtype, page_size_bytes=page_size_bytes, sliding_window=None)
    layer_first = layout.startswith("L")
    tensor = SimpleNamespace(
        size=NUM_BLOCKS * LAYERS * LAYER_PAGE, layers=[f"layer.{i}" for i in range(LAYERS)],
        layer_stride=NUM_BLOCKS * LAYER_PAGE if layer_first else LAYER_PAGE,
        block_stride=LAYER_PAGE if layer_first else LAYERS * LAYER_PAGE, offset=0)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                           kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)] * groups,
                           kv_cache_layout=layout)


@pytest.mark.parametrize("layout,order", [("LBHNC", "HNC"), ("LBNHC", "NHC"), ("BLHNC", "HNC")])
def test_a_block_is_one_page_across_layers(layout: str, order: str) -> None:
    geometry = page_geometry(vllm_config(), kv_cache_config(layout))
    assert geometry.layout.page_bytes == LAYERS * LAYER_PAGE
    assert geometry.layout.segment_bytes * 2 == LAYER_PAGE
    assert geometry.namespace.layout == f"vllm:cpu:{order}"
    assert geometry.namespace.model_id.startswith("/models/tiny#")


def test_each_tensor_parallel_rank_is_its_own_namespace() -> None:
    geometry = page_geometry(vllm_config(tp_size=2, rank=1), kv_cache_config())
    assert (geometry.namespace.tp_rank, geometry.namespace.tp_world_size) == (1, 2)
    assert geometry.for_rank(0).fingerprint != geometry.namespace.fingerprint


@pytest.mark.parametrize("config,message", [
    (dict(groups=2), "one KV cache group in one allocation"),
    (dict(spec_name="SlidingWindowSpec"), "full attention only, not SlidingWindowSpec"),
    (dict(spec_name="MLAAttentionSpec"), "full attention only, not MLAAttentionSpec"),
    (dict(layout="LHBNC"), "set VLLM_KV_CACHE_LAYOUT=LBHNC"),
    (dict(layout="XYZ"), "does not know KV cache layout 'XYZ'"),
    (dict(dtype=torch.complex64), "does not support KV dtype"),
    (dict(page_size_bytes=LAYER_PAGE + 64), "K and V of equal size with nothing else"),
])
def test_a_kv_cache_kvtier_cannot_hold_is_refused_with_the_reason(config: dict,
                                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        page_geometry(vllm_config(), kv_cache_config(**config))


def test_pipeline_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        page_geometry(vllm_config(pp_size=2), kv_cache_config())


def layer_views(buffer: torch.Tensor, layer_stride: int, block_stride: int) -> dict:
    """vLLM's per-layer `[B, H, N, C]` float32 views over one int8 buffer."""
    views = {}
    for layer in range(LAYERS):
        views[f"layer.{layer}"] = torch.as_strided(
            buffer.view(torch.float32), (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD),
            (block_stride // 4, BLOCK * 2 * HEAD, 2 * HEAD, 1), layer * layer_stride // 4)
    return views


def test_the_tensors_are_checked_where_the_geometry_says_they_are() -> None:
    geometry = page_geometry(vllm_config(), kv_cache_config())
    buffer = torch.zeros(geometry.buffer_bytes, dtype=torch.int8)
    views = layer_views(buffer, NUM_BLOCKS * LAYER_PAGE, LAYER_PAGE)
    assert check_tensors(geometry, views) == buffer.data_ptr()
    shifted = layer_views(buffer, NUM_BLOCKS * LAYER_PAGE - LAYER_PAGE, LAYER_PAGE)
    with pytest.raises(ConfigError, match="layer layer.1, block 0"):
        check_tensors(geometry, shifted)
    with pytest.raises(ConfigError, match="no KV cache for layer layer.1"):
        check_tensors(geometry, {"layer.0": views["layer.0"]})


def request(tokens: list[int], **extra: object) -> SimpleNamespace:
    fields = dict(all_token_ids=tokens, mm_features=[], prompt_embeds=None, lora_request=None,
                  cache_salt=None)
    return SimpleNamespace(**{**fields, **extra})


def test_keys_name_full_blocks_and_keep_salts_and_adapters_apart() -> None:
    namespace = page_geometry(vllm_config(), kv_cache_config()).namespace
    tokens = list(range(3 * BLOCK + 5))
    keys = request_keys(namespace, request(tokens))
    assert len(keys) == 3 and keys == request_keys(namespace, request(tokens))
    salted = request_keys(namespace, request(tokens, cache_salt="tenant-a"))
    adapted = request_keys(namespace, request(tokens, lora_request=SimpleNamespace(
        lora_name="sql", lora_path="/adapters/sql")))
    assert len({keys[0], salted[0], adapted[0]}) == 3
    assert request_keys(namespace, request(tokens, mm_features=["image"])) is None


def test_keys_are_the_same_in_another_process_with_another_hash_seed() -> None:
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
              "import test_vllm_options as t; "
              "ns = t.page_geometry(t.vllm_config(), t.kv_cache_config()).namespace; "
              "print(t.request_keys(ns, t.request(list(range(100))))[-1].hex())")
    here = page_geometry(vllm_config(), kv_cache_config()).namespace
    expected = request_keys(here, request(list(range(100))))[-1].hex()
    for seed in ("1", "2"):
        printed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        assert printed.stdout.strip() == expected
