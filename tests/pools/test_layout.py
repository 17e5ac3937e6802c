"""Pool geometry is a leaf: `kvtier.pools.layout` loads with no other kvtier module but errors
(and its package, which loads nothing), so the client, the daemon, the transfer lanes and the
vLLM connector can all build on it without an import cycle (pools.py and transfer/jobs.py
imported each other before it existed)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvtier.errors import ProtocolError
from kvtier.pools.layout import PoolLayout, check_page_ids

SCRIPT = """
import sys
import kvtier.pools.layout
print(sorted(name for name in sys.modules if name.startswith("kvtier")))
"""


def test_pool_layout_imports_no_other_kvtier_module() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("['kvtier', 'kvtier.errors', 'kvtier.pools', "
                                     "'kvtier.pools.layout']")


def test_layer_first_view_addresses_each_segment_where_the_layout_says() -> None:
    layout = PoolLayout.layer_first(num_pages=3, num_layers=2, page_tokens=2, num_kv_heads=1,
                                    head_dim=4, dtype="float16")
    segment = np.arange(layout.span_bytes, dtype=np.int64).astype(np.uint8)
    view = layout.page_view(segment)
    assert view.shape == (3, 2, 2, layout.segment_bytes)
    start = layout.layer_stride_bytes + layout.kv_stride_bytes + 2 * layout.page_stride_bytes
    assert (view[2, 1, 1] == segment[start : start + layout.segment_bytes]).all()


def test_check_page_ids_names_the_page_out_of_range() -> None:
    assert check_page_ids([0, 2], 3) == [0, 2]
    with pytest.raises(ProtocolError, match="page id 3 is out of range"):
        check_page_ids([0, 3], 3)
