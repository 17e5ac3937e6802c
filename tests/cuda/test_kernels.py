"""CUDA kernel sources: shipped, readable, and compiling with NVRTC (what CuPy compiles them
with on a GPU machine; the nvidia-cuda-nvrtc-cu12 wheel of the test extra brings it, no GPU
needed) and with nvcc where it is installed."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.cuda import kernel_names, kernel_source
from kvtier.transfer.cuda import KERNEL_OPTIONS

ENTRY_POINTS = {"page_copy.cu": {"gather_segments", "scatter_segments"}}  # what the backend loads
TARGET_ARCHES = ("compute_80", "compute_90")  # A100, H100 / H200


def load_nvrtc() -> ctypes.CDLL | None:
    """NVRTC from the nvidia-cuda-nvrtc-cu12 wheel, or None where it is not installed."""
    try:
        import nvidia.cuda_nvrtc
    except ImportError:
        return None
    lib_dir = Path(nvidia.cuda_nvrtc.__path__[0]) / "lib"
    libraries = sorted(lib_dir.glob("libnvrtc.so.*"))  # .12 from the cu12 wheel, .13 from cu13
    if not libraries:
        return None
    for builtins in sorted(lib_dir.glob("libnvrtc-builtins.so*")):  # NVRTC loads it by name
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(libraries[-1]))


def compile_with_nvrtc(nvrtc: ctypes.CDLL, source: str, name: str,
                       options: tuple[str, ...]) -> tuple[int, str, str]:
    """(result code, compile log, PTX) of one NVRTC compile."""
    program = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0,
                                    None, None) == 0
    try:
        encoded = [option.encode() for option in options]
        code = nvrtc.nvrtcCompileProgram(program, len(encoded),
                                         (ctypes.c_char_p * len(encoded))(*encoded))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        ptx = ctypes.create_string_buffer(0)
        if code == 0:
            nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
            ptx = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetPTX(program, ptx)
        return code, log.value.decode(), ptx.value.decode()
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def test_kernels_are_found_as_package_data() -> None:
    assert "page_copy.cu" in kernel_names()
    assert "gather_segments" in kernel_source("page_copy.cu")


@pytest.mark.parametrize("arch", TARGET_ARCHES)
@pytest.mark.parametrize("name", kernel_names())
def test_every_kernel_compiles_with_nvrtc_as_the_cuda_backend_asks(name: str, arch: str) -> None:
    nvrtc = load_nvrtc()
    if nvrtc is None:
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12)")
    code, log, ptx = compile_with_nvrtc(nvrtc, kernel_source(name), name,
                                        (*KERNEL_OPTIONS, f"-arch={arch}"))
    assert code == 0, log
    assert ENTRY_POINTS.get(name, set()) <= set(re.findall(r"\.entry\s+(\w+)", ptx))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("name", kernel_names())
def test_every_kernel_compiles_with_nvcc(name: str, tmp_path: Path) -> None:
    source = tmp_path / name
    source.write_text(kernel_source(name))
    done = subprocess.run(["nvcc", "--ptx", "-arch=compute_80", "-o", str(tmp_path / "out.ptx"),
                           str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "gather_segments" in (tmp_path / "out.ptx").read_text() or name != "page_copy.cu"


@pytest.mark.gpu
def test_the_cuda_backend_compiles_and_loads_its_kernels(cupy) -> None:
    from kvtier.transfer.cuda import CudaBackend

    backend = CudaBackend(pin_arena=False)
    try:
        assert backend.gather is not None and backend.scatter is not None
    finally:
        backend.close()
