"""The SGLang backend's pieces that need no SGLang: host layouts as `PoolLayout`s, namespaces,
keys and options. The layouts are checked against SGLang 0.5.23's buffer shapes
(`MHATokenToKVPoolHost.init_kv_buffer`), written out here, and through the real pools in
tests/integrations/test_sglang.py."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kvtier.client.polling import DEFAULT_POLL_US
from kvtier.errors import ConfigError
from kvtier.integrations.sglang.geometry import host_layout, page_key, storage_namespace
from kvtier.integrations.sglang.options import BackendOptions

L, H, D, P, PAGES = 3, 2, 4, 8, 5  # layers, heads, dims, page tokens, host pages
SIZE = P * PAGES


class _Dtype:
    itemsize = 2

    def __str__(self) -> str:
        return "torch.bfloat16"


def fake_host(layout: str, kind: str = "MHATokenToKVPoolHost") -> SimpleNamespace:
    host_type = type(kind, (SimpleNamespace,), {})
    return host_type(layout=layout, dtype=_Dtype(), head_num=H, head_dim=D, v_head_dim=D,
                     layer_num=L, page_size=P, size=SIZE, page_num=PAGES, dcp_size=1)


# SGLang's host buffer shapes: axis names -> sizes, K/V first.
SHAPES = {
    "layer_first": ("kv layer token head dim", (2, L, SIZE, H, D)),
    "page_first": ("kv token layer head dim", (2, SIZE, L, H, D)),
    "page_first_direct": ("kv page layer ptoken head dim", (2, PAGES, L, P, H, D)),
    "page_head": ("kv page head ptoken layer dim", (2, PAGES, H, P, L, D)),
}


def elements_of_page(layout: str, page: int) -> set[int]:
    """Flat element indices of host page `page` (every layer, K and V) in SGLang's buffer."""
    names, shape = SHAPES[layout]
    index = np.arange(int(np.prod(shape))).reshape(shape)
    axes = names.split()
    selector = [slice(page * P, (page + 1) * P) if axis == "token" else
                page if axis == "page" else slice(None) for axis in axes]
    return set(index[tuple(selector)].ravel().tolist())


@pytest.mark.parametrize("layout", list(SHAPES))
def test_each_layout_covers_exactly_its_pages_elements(layout: str) -> None:
    pool = host_layout(fake_host(layout))
    assert pool.span_bytes == 2 * L * SIZE * H * D * 2  # the whole buffer, nothing past it
    for page in range(PAGES):
        elements = {(page * pool.page_stride_bytes + layer * pool.layer_stride_bytes
                     + kv * pool.kv_stride_bytes + offset) // 2
                    for layer in range(L) for kv in (0, 1)
                    for offset in range(0, pool.segment_bytes, 2)}
        assert elements == elements_of_page(layout, page), (layout, page)


def test_layouts_kvtier_cannot_describe_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="page_unified"):
        host_layout(fake_host("page_unified"))
    with pytest.raises(ConfigError, match="MLATokenToKVPoolHost"):
        host_layout(fake_host("page_first", kind="MLATokenToKVPoolHost"))
    uneven = fake_host("page_first")
    uneven.v_head_dim = 2
    with pytest.raises(ConfigError, match="one width"):
        host_layout(uneven)


def _config(**fields: object) -> SimpleNamespace:
    base = dict(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False)
    return SimpleNamespace(**{**base, **fields})


def test_namespaces_keep_ranks_layouts_and_models_apart() -> None:
    host = fake_host("page_first")
    pool = host_layout(host)
    rank0 = storage_namespace(_config(tp_rank=0), host, pool, "m")
    rank1 = storage_namespace(_config(tp_rank=1), host, pool, "m")
    other_layout = storage_namespace(_config(), fake_host("page_head"),
                                     host_layout(fake_host("page_head")), "m")
    other_model = storage_namespace(_config(), host, pool, "m2")
    fingerprints = {ns.fingerprint for ns in (rank0, rank1, other_layout, other_model)}
    assert len(fingerprints) == 4
    assert (rank1.tp_rank, rank1.tp_world_size, rank1.page_tokens) == (1, 2, P)
    # MLA: every rank holds the same pages, so they share one namespace.
    mla = {storage_namespace(_config(tp_rank=r, is_mla_model=True), host, pool, "m").fingerprint
           for r in (0, 1)}
    assert len(mla) == 1


def test_page_keys_are_16_bytes_and_distinct() -> None:
    keys = [page_key(f"{n:064x}") for n in range(1000)]
    assert {len(k) for k in keys} == {16} and len(set(keys)) == 1000


def test_options_are_read_and_bad_ones_refused() -> None:
    options = BackendOptions.from_extra_config({"socket": "/s", "timeout_s": 5, "other": 1})
    assert (options.socket, options.timeout_s, options.model_id) == ("/s", 5.0, "")
    assert options.poll_us == DEFAULT_POLL_US
    assert BackendOptions.from_extra_config({"poll_us": 0}).poll_us == 0.0
    for bad in (-1, 20_000, "off", True):
        with pytest.raises(ConfigError, match="'poll_us' must be between 0"):
            BackendOptions.from_extra_config({"poll_us": bad})
    with pytest.raises(ConfigError, match="reconnect_s"):
        BackendOptions.from_extra_config({"reconnect_s": -1})
    with pytest.raises(ConfigError, match="socket"):
        BackendOptions.from_extra_config({"socket": 3})


def test_the_package_imports_without_sglang() -> None:
    import kvtier.integrations.sglang as package

    assert "sglang" not in sys.modules
    assert package.__all__ == ["KvtierHiCacheStorage"]
