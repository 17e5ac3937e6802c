"""`kvtier` re-exports the public API, loading each name on first use: `import kvtier` alone loads
no submodule, and using the whole API loads neither torch nor CuPy."""

from __future__ import annotations

import importlib
import subprocess
import sys

import kvtier

SCRIPT = """
import sys
import kvtier
assert sorted(n for n in sys.modules if n.startswith("kvtier.")) == [], sys.modules
for name in kvtier.__all__:
    getattr(kvtier, name)
for name in ("torch", "cupy"):
    assert name not in sys.modules, name + " was imported"
print("ok")
"""


def test_every_public_name_is_its_modules_own_object() -> None:
    for name, module in kvtier._NAME_TO_MODULE.items():
        assert getattr(kvtier, name) is getattr(importlib.import_module(module), name), name
    assert set(kvtier.__all__) <= set(dir(kvtier))


def test_import_kvtier_is_lazy_and_torch_and_cupy_free() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"

