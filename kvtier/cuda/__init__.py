"""CUDA kernel sources shipped with kvtier, read at run time by the CUDA transfer backend.

`kernel_source(name)` returns the text of `name` (e.g. "page_copy.cu"); `kernel_names()` lists them.
Nothing here imports CuPy: compiling is the CUDA backend's job, on machines that have a GPU.
"""

from __future__ import annotations

from importlib import resources


def kernel_names() -> list[str]:
    """The .cu files shipped in this package."""
    return sorted(p.name for p in resources.files(__name__).iterdir() if p.name.endswith(".cu"))


def kernel_source(name: str) -> str:
    """The source text of kernel file `name`."""
    return resources.files(__name__).joinpath(name).read_text()
