"""How SGLang's HiCache host pool maps onto kvtier pages: one SGLang host page is one kvtier page.

SGLang's MHA host pool (`MHATokenToKVPoolHost`) keeps K and V in one `[2, ...]` buffer, V at a
fixed offset after K. Per layout, a page's K (and its V) is:

- `layer_first` `(2, L, size, H, D)`: one run of `page * H * D` elements per layer;
- `page_first` `(2, size, L, H, D)`, `page_first_direct` `(2, pages, L, page, H, D)` and
  `page_head` `(2, pages, H, page, L, D)`: one run of `L * page * H * D` elements.

That is a `PoolLayout` as it stands: a segment is `page * H * D` elements, and for the page-first
family a page's K run is cut into its `L` segments in memory order (in `page_first_direct` those
are the layers; in the other two, equal slices of the interleaved run). The daemon stores the
same bytes in the same order and gives them back in it; the layout's name is in the namespace, so
pages of two layouts never mix. `check_layout` proves the real pool sits where the layout says,
against SGLang's own `get_page_buffer_meta`. Anything else (MLA and hybrid pools, `page_unified`,
split-head TP, K and V of different widths) is refused at attach with the reason.

`storage_namespace` names the pages: model, KV dtype, layout, page size, tensor-parallel rank
and size (and pipeline / context-parallel rank when used). SGLang's keys are bare page-chain
hashes; `page_key` turns each into kvtier's 16-byte key.
Verbs: `host_layout`, `check_layout`, `storage_namespace`, `page_key`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, Namespace
from kvtier.pools.layout import PoolLayout

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_HOST_POOL_TYPES = ("MHATokenToKVPoolHost",)
_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16",
                 "torch.bfloat16": "bfloat16", "torch.float8_e4m3fn": "float8_e4m3fn",
                 "torch.float8_e5m2": "float8_e5m2", "torch.int8": "int8", "torch.uint8": "uint8"}
_KEY_PERSON = b"kvtier-sglang"


def host_layout(host: Any) -> PoolLayout:
    """The `PoolLayout` of SGLang host pool `host` (its `kv_buffer`, from byte 0).

    Raises:
        ConfigError: a pool or layout kvtier cannot describe, naming what is supported.
    """
    kind = type(host).__name__
    if kind not in _HOST_POOL_TYPES:
        raise ConfigError(f"kvtier's SGLang backend supports MHA host pools "
                          f"({', '.join(_HOST_POOL_TYPES)}), not {kind} (MLA, hybrid and "
                          f"quantized-scale pools are not supported yet)")
    if host.layout not in SUPPORTED_LAYOUTS:
        raise ConfigError(f"kvtier's SGLang backend does not support --hicache-mem-layout "
                          f"{host.layout}; use one of {', '.join(SUPPORTED_LAYOUTS)}")
    dtype = _TORCH_DTYPES.get(str(host.dtype))
    if dtype is None:
        raise ConfigError(f"kvtier's SGLang backend does not support KV dtype {host.dtype}")
    if host.v_head_dim != host.head_dim:
        raise ConfigError(f"kvtier's SGLang backend needs K and V of one width; this model's K "
                          f"is {host.head_dim} wide and V {host.v_head_dim}")
    if getattr(host, "dcp_size", 1) != 1:
        raise ConfigError("kvtier's SGLang backend does not support decode context parallelism")
    item = host.dtype.itemsize
    token_bytes = host.head_num * host.head_dim * item
    segment_bytes = host.page_size * token_bytes
    layer_bytes = host.size * token_bytes  # one layer's K over the whole pool
    if host.layout == "layer_first":
        page_stride, layer_stride = segment_bytes, layer_bytes
    else:
        page_stride, layer_stride = host.layer_num * segment_bytes, segment_bytes
    layout = PoolLayout(num_pages=host.page_num, num_layers=host.layer_num,
                        page_tokens=host.page_size, num_kv_heads=host.head_num,
                        head_dim=host.head_dim, dtype=dtype, page_stride_bytes=page_stride,
                        layer_stride_bytes=layer_stride,
                        kv_stride_bytes=host.layer_num * layer_bytes)
    layout.validate(2 * host.layer_num * layer_bytes)
    return layout


def check_layout(host: Any, layout: PoolLayout) -> None:
    """Check `layout` covers exactly the bytes SGLang's `get_page_buffer_meta` names for the
    first and last pages of `host`.

    Raises:
        ConfigError: they differ (an SGLang version whose pool kvtier does not know).
    """
    import torch  # SGLang's pools are torch tensors; kvtier itself does not need torch

    base = host.kv_buffer.data_ptr()
    for page in (0, layout.num_pages - 1):
        indices = torch.arange(page * host.page_size, (page + 1) * host.page_size)
        pointers, sizes = host.get_page_buffer_meta(indices)
        theirs = _merged([(ptr - base, size) for ptr, size in zip(pointers, sizes)])
        ours = _merged([(page * layout.page_stride_bytes + layer * layout.layer_stride_bytes
                         + kv * layout.kv_stride_bytes, layout.segment_bytes)
                        for kv in (0, 1) for layer in range(layout.num_layers)])
        if theirs != ours:
            raise ConfigError(f"SGLang's {host.layout} host pool keeps page {page} at "
                              f"{theirs[:4]}, but kvtier expects {ours[:4]}: this SGLang version "
                              f"lays its host pool out in a way kvtier does not know")


def _merged(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, size) regions sorted, adjacent ones joined."""
    merged: list[tuple[int, int]] = []
    for offset, size in sorted(regions):
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((offset, size))
    return merged


def storage_namespace(config: Any, host: Any, layout: PoolLayout, model_id: str) -> Namespace:
    """The namespace of this rank's pages, from SGLang's `HiCacheStorageConfig`.

    With `is_mla_model` every rank holds the same pages: one namespace for all of them (SGLang
    lets one rank write; every rank reads). Otherwise each tensor-parallel rank has its own.
    """
    parts = [f"sglang:{host.layout}"]
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}/{config.pp_size}")
    if getattr(config, "attn_cp_size", 1) > 1:
        parts.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    tag = getattr(host, "storage_format_tag", None)
    if tag:
        parts.append(str(tag))
    shared = bool(config.is_mla_model)
    return Namespace(model_id=model_id, dtype=layout.dtype, layout=":".join(parts),
                     page_tokens=layout.page_tokens, page_bytes=layout.page_bytes,
                     tp_rank=0 if shared else config.tp_rank,
                     tp_world_size=1 if shared else config.tp_size)


def page_key(sglang_key: str) -> bytes:
    """kvtier's key for SGLang's page key (a hex SHA-256 chain hash, or any string)."""
    return hashlib.blake2b(sglang_key.encode(), digest_size=KEY_BYTES,
                           person=_KEY_PERSON).digest()
