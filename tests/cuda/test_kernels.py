"""CUDA kernel sources: shipped, readable, and compiling with nvcc where it is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.cuda import kernel_names, kernel_source


def test_kernels_are_found_as_package_data() -> None:
    assert "page_copy.cu" in kernel_names()
    assert "gather_segments" in kernel_source("page_copy.cu")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("name", kernel_names())
def test_every_kernel_compiles_with_nvcc(name: str, tmp_path: Path) -> None:
    source = tmp_path / name
    source.write_text(kernel_source(name))
    done = subprocess.run(["nvcc", "--ptx", "-arch=compute_80", "-o", str(tmp_path / "out.ptx"),
                           str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "gather_segments" in (tmp_path / "out.ptx").read_text() or name != "page_copy.cu"
