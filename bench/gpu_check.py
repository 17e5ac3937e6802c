"""One GPU acceptance run for the transfer engine, under five minutes on one GPU.

Run:

    python bench/gpu_check.py

Runs `pytest -m gpu` over tests/transfer, tests/cuda, tests/store/test_store_cuda.py (the store on
the CUDA engine: device pools, rotate, the hbm tier in device memory) and
tests/daemon/test_device_pools.py (a real daemon's CUDA engine), then
`bench/bench_transfer.py --backend cuda`, and prints one table: H2D and D2H GB/s alone and
together beside a plain pinned cudaMemcpyAsync of one large buffer measured in the same run, plus
the batched store against one cudaMemcpyAsync per segment and hbm recalls (device to device)
against a plain device copy. Targets: each lane >= 0.8 of that peak with fragmented (layer-first,
random-slot) pages; both lanes together >= 1.6x one lane alone. Exits non-zero when CuPy or a GPU
is missing, a test fails, or a target is missed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANE_TARGET, DUPLEX_TARGET = 0.8, 1.6


def main() -> int:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device visible")
        # The kernels compile with NVRTC: missing, nothing CUDA runs. CuPy 14 keeps its binding
        # in cupy_backends only (cupy.cuda.nvrtc is gone there).
        from cupy_backends.cuda.libs import nvrtc

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        print(f"gpu_check: CuPy {cupy.__version__}, CUDA runtime "
              f"{cupy.cuda.runtime.runtimeGetVersion()}, NVRTC {nvrtc.getVersion()}, "
              f"{name.decode() if isinstance(name, bytes) else name}")
    except Exception as exc:  # ImportError or a CUDA runtime error: say which, fail loudly
        print(f"gpu_check: FAILED: needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    try:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q",
                                "-p", "no:cacheprovider", "tests/transfer", "tests/cuda",
                                "tests/store/test_store_cuda.py",
                                "tests/daemon/test_device_pools.py"],
                               cwd=ROOT, timeout=180)
        bench = subprocess.run([sys.executable, "bench/bench_transfer.py", "--json", "--backend",
                                "cuda", "--pages", "256"], cwd=ROOT, capture_output=True,
                               text=True, timeout=100)
    except subprocess.TimeoutExpired as exc:
        print(f"gpu_check: FAILED: {' '.join(exc.cmd[1:3])} ran past {exc.timeout} s",
              file=sys.stderr)
        return 1
    if bench.returncode != 0:
        print(bench.stderr, file=sys.stderr)
        print("gpu_check: FAILED: the CUDA bench did not run", file=sys.stderr)
        return 1
    r = json.loads(bench.stdout)
    rows = [("D2H lane", r["d2h_gbps"], r["plain_d2h_gbps"], r["lane_ratio_d2h"], LANE_TARGET),
            ("H2D lane", r["h2d_gbps"], r["plain_h2d_gbps"], r["lane_ratio_h2d"], LANE_TARGET),
            ("both lanes", r["duplex_gbps"], max(r["d2h_gbps"], r["h2d_gbps"]),
             r["duplex_vs_one_lane"], DUPLEX_TARGET),
            ("hbm->pool", r["d2d_gbps"], r["plain_d2d_gbps"], r["hbm_ratio"], None),
            ("batched D2H", r["d2h_gbps"], r["d2h_gbps"] / r["batch_speedup"],
             r["batch_speedup"], None)]
    print(f"{'':<12}{'GB/s':>8}{'baseline':>10}{'ratio':>8}{'target':>8}  ok")
    ok = tests.returncode == 0
    for name, value, base, ratio, target in rows:
        if target is None:  # a figure to read, not a target: hbm copies, the naive loop
            print(f"{name:<12}{value:>8.2f}{base:>10.2f}{ratio:>8.2f}{'-':>8}  -")
            continue
        print(f"{name:<12}{value:>8.2f}{base:>10.2f}{ratio:>8.2f}{target:>8.2f}  "
              f"{'yes' if ratio >= target else 'NO'}")
        ok &= ratio >= target
    print(f"gpu tests: {'passed' if tests.returncode == 0 else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
