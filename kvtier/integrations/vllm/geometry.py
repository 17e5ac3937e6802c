"""How vLLM's KV memory maps onto kvtier pages: one vLLM block is one kvtier page.

vLLM (0.32) puts every attention layer of a model in one backing allocation: layer `l` of block
`b` starts at `offset + l * layer_stride + b * block_stride` bytes, and with a block-contiguous
layout (`LBHNC`, `LBNHC`, `BLHNC`, ...) that layer's part of the block is one run of
`page_size_bytes`: its K and V for every head and token. That is a `PoolLayout` as it stands,
with the run cut in two equal segments, so kvtier moves a block with no re-layout copy in the
engine. `page_geometry` derives it from the engine's KV cache config (the scheduler and the
worker derive the same one, so they agree on the namespace); `check_tensors` proves the worker's
real tensors sit where it says. Anything else (several cache groups, sliding windows, MLA,
quantized caches with scales, head-outer layouts) is refused at engine start with the reason.

`request_keys` names a request's full blocks with kvtier's chained prefix keys over token ids
(never Python's `hash()`, never vLLM's per-process block hashes), seeded by the request's LoRA
adapter and cache salt, so the same tokens give the same keys in every process and after restarts.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, Namespace, prefix_keys
from kvtier.pools.layout import DTYPE_BYTES, PoolLayout

_TORCH_TO_DTYPE = {torch.float32: "float32", torch.float16: "float16",
                   torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn",
                   torch.float8_e5m2: "float8_e5m2", torch.int8: "int8", torch.uint8: "uint8"}
_LOGICAL_DIMS = "LBHNC"  # vLLM's logical KV cache axes: layer, block, head, token, content


@dataclass(slots=True, frozen=True)
class PageGeometry:
    """Where one engine's pages live and what they are called.

    Attributes:
        namespace: the pages' namespace for this process's tensor-parallel rank.
        layout: the engine's KV memory as a kvtier pool (page = vLLM block).
        buffer_bytes: size of the backing allocation the layout indexes.
        layer_names: the attention layers, in the order the layout counts them.
    """

    namespace: Namespace
    layout: PoolLayout
    buffer_bytes: int
    layer_names: tuple[str, ...]

    def for_rank(self, tp_rank: int) -> Namespace:
        """The namespace of the same pages on another tensor-parallel rank."""
        return dataclasses.replace(self.namespace, tp_rank=tp_rank)


def page_geometry(vllm_config: Any, kv_cache_config: Any, model_id: str = "") -> PageGeometry:
    """The geometry of the engine configured by `vllm_config` with `kv_cache_config`.

    Raises:
        ConfigError: the engine's KV cache is not one kvtier can hold, naming why.
    """
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) != 1:
        raise ConfigError("the kvtier connector does not support pipeline parallelism yet "
                          "(pipeline_parallel_size must be 1)")
    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    if len(groups) != 1 or len(tensors) != 1:
        raise ConfigError(f"the kvtier connector needs one KV cache group in one allocation; "
                          f"this model has {len(groups)} groups in {len(tensors)} (hybrid, "
                          f"sliding-window or multi-spec models are not supported)")
    spec, tensor = groups[0].kv_cache_spec, tensors[0]
    kind = type(spec).__name__
    if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None) is not None:
        raise ConfigError(f"the kvtier connector supports full attention only, not {kind}")
    dtype = _TORCH_TO_DTYPE.get(spec.dtype)
    if dtype is None:
        raise ConfigError(f"the kvtier connector does not support KV dtype {spec.dtype}")
    segment_bytes = spec.block_size * spec.num_kv_heads * spec.head_size * DTYPE_BYTES[dtype]
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size or \
            spec.page_size_bytes != 2 * segment_bytes:
        raise ConfigError(f"the kvtier connector needs a page of K and V of equal size with "
                          f"nothing else; this model's page is {spec.page_size_bytes} bytes, "
                          f"K and V {2 * segment_bytes}")
    order = _block_order(kv_cache_config.kv_cache_layout)
    layout = PoolLayout(
        num_pages=kv_cache_config.num_blocks, num_layers=len(tensor.layers),
        page_tokens=spec.block_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
        dtype=dtype, page_stride_bytes=tensor.block_stride, layer_stride_bytes=tensor.layer_stride,
        kv_stride_bytes=segment_bytes, offset_bytes=tensor.offset)
    layout.validate(tensor.size)
    device = vllm_config.device_config.device_type if vllm_config.device_config else "cuda"
    namespace = Namespace(
        model_id=model_id or _model_id(vllm_config), dtype=dtype,
        layout=f"vllm:{device}:{order}", page_tokens=spec.block_size,
        page_bytes=layout.page_bytes, tp_rank=_tp_rank(parallel),
        tp_world_size=parallel.tensor_parallel_size)
    return PageGeometry(namespace, layout, tensor.size, tuple(tensor.layers))


def _block_order(layout_name: str | None) -> str:
    """The order of a block's bytes ("HNC", "NHC") in a layout named by its physical axis order
    (vLLM's `KVCacheLayout` names: "LBHNC" is layer, block, head, token, content), which must be
    contiguous per layer and block.

    Raises:
        ConfigError: not a layout name, or one whose blocks are spread over the memory.
    """
    name = layout_name or "LBHNC"
    if sorted(name) != sorted(_LOGICAL_DIMS):
        raise ConfigError(f"the kvtier connector does not know KV cache layout {name!r}")
    if name.index("B") > min(name.index(axis) for axis in "HNC"):
        raise ConfigError(f"KV cache layout {name} spreads a block over the memory (heads "
                          f"outside blocks): set VLLM_KV_CACHE_LAYOUT=LBHNC for kvtier")
    return "".join(axis for axis in name if axis in "HNC")


def _tp_rank(parallel: Any) -> int:
    rank = getattr(parallel, "rank", 0) or 0
    return rank % max(parallel.tensor_parallel_size, 1)


def _model_id(vllm_config: Any) -> str:
    """The model's path or name, then a hash of its config, revision, quantization and KV dtype:
    models that differ in any of them never share pages. Weights are not hashed: set `model_id`
    when one path can hold different weights (a model rewritten in place)."""
    model = vllm_config.model_config
    described = "\0".join(str(part) for part in (
        model.hf_config.to_json_string(use_diff=False), model.revision, model.quantization,
        model.dtype, vllm_config.cache_config.cache_dtype))
    digest = hashlib.blake2b(described.encode(), digest_size=8).hexdigest()
    return f"{model.model}#{digest}"


def check_tensors(geometry: PageGeometry, kv_caches: Mapping[str, torch.Tensor]) -> int:
    """The address of the backing allocation, once every layer's tensor is where the geometry
    says: one storage, each layer's block a dense run at its offset.

    Raises:
        ConfigError: a layer is missing or lies elsewhere (a vLLM version kvtier does not know).
    """
    layout = geometry.layout
    missing = [name for name in geometry.layer_names if name not in kv_caches]
    if missing:
        raise ConfigError(f"vLLM registered no KV cache for layer {missing[0]}")
    first = kv_caches[geometry.layer_names[0]]
    base = first.untyped_storage().data_ptr()
    page_layer_bytes = 2 * layout.segment_bytes
    for index, name in enumerate(geometry.layer_names):
        tensor = kv_caches[name]
        if tensor.untyped_storage().data_ptr() != base:
            raise ConfigError(f"layer {name}'s KV cache is not in the shared allocation")
        per_page = tensor.shape[0] // layout.num_pages  # kernel blocks per vLLM block
        if per_page < 1 or tensor.shape[0] % layout.num_pages:
            raise ConfigError(f"layer {name} has {tensor.shape[0]} blocks for "
                              f"{layout.num_pages} pages")
        for page in (0, layout.num_pages - 1):
            start, size = _dense_span(tensor[page * per_page:(page + 1) * per_page])
            expected = (base + layout.offset_bytes + index * layout.layer_stride_bytes
                        + page * layout.page_stride_bytes)
            if (start, size) != (expected, page_layer_bytes):
                raise ConfigError(
                    f"layer {name}, block {page}: {size} bytes at offset {start - base}, but "
                    f"kvtier expects {page_layer_bytes} at {expected - base}; this vLLM lays "
                    f"its KV cache out in a way the kvtier connector does not know")
    return base


def _dense_span(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the elements of `tensor`, or (address, -1) when they leave gaps."""
    dims = sorted((tensor.stride(d), tensor.shape[d]) for d in range(tensor.dim())
                  if tensor.shape[d] > 1)
    expected_stride = 1
    for stride, size in dims:
        if stride != expected_stride:
            return tensor.data_ptr(), -1
        expected_stride *= size
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def request_keys(namespace: Namespace, request: Any) -> list[bytes] | None:
    """The keys of every full block of `request`'s tokens so far, or None when kvtier must
    leave the request alone (multimodal inputs or prompt embeddings: tokens do not name its KV).
    """
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) \
            is not None:
        return None
    return prefix_keys(namespace, list(request.all_token_ids), _chain_seed(request))


def _chain_seed(request: Any) -> bytes | None:
    """A parent key for the first block that sets apart a LoRA adapter's or a cache salt's KV."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    if lora is None and not salt:
        return None
    described = "\0".join((getattr(lora, "lora_name", ""), str(getattr(lora, "lora_path", "")),
                           salt or ""))
    return hashlib.blake2b(described.encode(), digest_size=KEY_BYTES,
                           person=b"kvtier-vllm-seed").digest()
