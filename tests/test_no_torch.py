"""Importing and using kvtier never imports torch or CuPy (they belong to engines and CUDA)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, tempfile
from pathlib import Path
import numpy as np
import kvtier, kvtier.store.page_store
from kvtier.config import DiskConfig, HostConfig, StoreConfig
from kvtier.keys import Namespace, prefix_keys
from kvtier.store.page_store import PageStore

with tempfile.TemporaryDirectory() as tmp:
    config = StoreConfig(host=HostConfig(capacity_bytes=2 * 4096, chunk_bytes=4096),
                         disk=DiskConfig(path=Path(tmp) / "disk", capacity_bytes=4 * 8192,
                                         chunk_bytes=8192))
    ns = Namespace("m", "bfloat16", "page-first", 4, 4096)
    keys = prefix_keys(ns, list(range(12)))
    pages = np.random.default_rng(0).integers(0, 256, (3, 4096), dtype=np.uint8)
    with PageStore(config) as store:
        assert store.store(ns, keys, pages).ok
        out = np.zeros_like(pages)
        assert store.recall(ns, keys, out).ok and (out == pages).all()
        assert store.check() == []
for name in ("torch", "cupy"):
    assert name not in sys.modules, name + " was imported"
print("ok")
"""


def test_kvtier_runs_without_importing_torch_or_cupy(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
