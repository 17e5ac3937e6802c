"""SGLang HiCache backup and prefetch GB/s through SGLang's own controller: kvtier against
SGLang's `file` backend and against a plain copy of the same bytes.

Run:

    python bench/bench_sglang.py [--json] [--pages 64] [--rounds 9]

Needs the SGLang environment (`bash .ci/install-sglang`, or KVTIER_SGLANG_PYTHON naming a
Python with sglang 0.5.23 and kvtier). Starts `kvtier serve` (1 GiB host tier) and one SGLang
rank (`kvtier.integrations.sglang.driver`: SGLang's real `HiCacheController` on CPU tensors,
`page_first` host layout, 16 layers x 16 tokens x 8 KV heads x 128 dims, bfloat16: 1 MiB
pages), then, per backend, `--rounds` rounds (the first a warm-up, not counted) of:

- backup: `write_storage` of `--pages` host pages under new page hashes, timed to SGLang's
  backup acknowledgement;
- prefetch: SGLang's hit query and transfer of those pages into fresh host pages, timed to its
  last prefetch acknowledgement (every page must land).

Backends: kvtier (zero-copy v1: the daemon copies between its host tier and SGLang's host pool)
and SGLang's `file` backend (its generic path, files in a temporary folder on this machine's
disk, so served from the page cache). Plain copy: as many pages' bytes copied out of the host
pool into a separate buffer and back (torch `copy_`), the machine's limit for what either moves:
each round other host pages and another buffer, as the kvtier rounds move new pages into new
slots; `copy_hot`: the same pages and buffer every round, whose 2 x 64 MiB a large last-level
cache keeps (this machine's holds 300 MiB), a limit no store of new pages can use.

Printed: median GB/s of each, `set_vs_file` / `get_vs_file` (kvtier over file, target >= 2),
`set_vs_copy` / `get_vs_copy` (kvtier over the plain copy, target >= 0.7) and
`set_vs_copy_hot` / `get_vs_copy_hot`. `--json` prints exactly one JSON object on stdout;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from kvtier.integrations.sglang.driver_process import RankProcess
from kvtier.testing.daemon_process import DaemonProcess

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = Path(os.environ.get("KVTIER_SGLANG_PYTHON",
                                    REPO / ".venv-sglang" / "bin" / "python"))
GEOMETRY = {"layers": 16, "heads": 8, "dim": 128, "page_size": 16, "pages": 128}
PAGE_BYTES = 2 * 16 * 16 * 8 * 128 * 2  # K and V x layers x tokens x heads x dim x bf16


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _rounds(rank: RankProcess, num_pages: int, rounds: int, seed_base: int) -> dict:
    """Median backup and prefetch GB/s over the counted rounds."""
    set_s, get_s = [], []
    for index in range(rounds):
        seed = seed_base + index
        backup = rank.call("backup", seed=seed, num_pages=num_pages, fill=False)
        prefetch = rank.call("prefetch", seed=seed, num_pages=num_pages, verify=False)
        tokens = num_pages * GEOMETRY["page_size"]
        if backup["completed_tokens"] != tokens or prefetch["completed_tokens"] != tokens:
            raise RuntimeError(f"round {index}: backup {backup}, prefetch {prefetch}\n"
                               f"{rank.log()}")
        if index:  # the first round warms up
            set_s.append(backup["seconds"])
            get_s.append(prefetch["seconds"])
    size = num_pages * PAGE_BYTES
    return {"set_gbps": size / statistics.median(set_s) / 1e9,
            "get_gbps": size / statistics.median(get_s) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if not SGLANG_PYTHON.exists():
        sys.exit(f"no SGLang environment at {SGLANG_PYTHON}: run `bash .ci/install-sglang`")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-sglang-") as tmp:
        folder = Path(tmp)
        socket_path = folder / "k.sock"
        _progress("starting kvtier serve and one SGLang rank")
        with DaemonProcess.start(socket_path, "--host-capacity", "1GiB", "--disk-path",
                                 str(folder / "disk"), "--disk-capacity", "256MiB") as daemon:
            rank = RankProcess(SGLANG_PYTHON, [], folder, timeout_s=600).wait_ready()
            try:
                figures = _measure(rank, str(daemon.socket_path), folder, args)
            finally:
                rank.close()
    if args.json:
        print(json.dumps(figures))
        return
    print(f"{args.pages} pages of {PAGE_BYTES >> 20} MiB per call, median of "
          f"{args.rounds - 1} rounds")
    for name in ("kvtier", "file", "copy", "copy_hot"):
        print(f"  {name:8s} backup {figures[name + '_set_gbps']:6.2f} GB/s   "
              f"prefetch {figures[name + '_get_gbps']:6.2f} GB/s")
    print(f"  kvtier / file: set {figures['set_vs_file']:.2f}x get {figures['get_vs_file']:.2f}x "
          f"(target >= 2); kvtier / copy: set {figures['set_vs_copy']:.2f} get "
          f"{figures['get_vs_copy']:.2f} (target >= 0.7); kvtier / hot copy: set "
          f"{figures['set_vs_copy_hot']:.2f} get {figures['get_vs_copy_hot']:.2f}")


def _copy_gbps(copy: dict) -> tuple[float, float]:
    """A plain copy's median GB/s out and back over its counted rounds (the first warms up)."""
    return (copy["bytes"] / statistics.median(copy["out_s"][1:]) / 1e9,
            copy["bytes"] / statistics.median(copy["back_s"][1:]) / 1e9)


def _measure(rank: RankProcess, socket_path: str, folder: Path,
             args: argparse.Namespace) -> dict:
    opened = rank.call("open", backend="kvtier", layout="page_first", socket=socket_path,
                       **GEOMETRY)
    if not opened.get("zero_copy"):
        raise RuntimeError(f"kvtier did not attach zero-copy: {opened}\n{rank.log()}")
    rank.call("fill_random")
    _progress("kvtier rounds")
    kvtier = _rounds(rank, args.pages, args.rounds, 1000)
    copy = rank.call("plain_copy", num_pages=args.pages, rounds=args.rounds, rotate=True)
    hot = rank.call("plain_copy", num_pages=args.pages, rounds=args.rounds)
    rank.call("open", backend="file", layout="page_first", file_dir=str(folder / "files"),
              **GEOMETRY)
    rank.call("fill_random")
    _progress("file backend rounds")
    file = _rounds(rank, args.pages, args.rounds, 2000)
    copy_set, copy_get = _copy_gbps(copy)
    hot_set, hot_get = _copy_gbps(hot)
    return {
        "pages": args.pages, "page_bytes": PAGE_BYTES, "rounds": args.rounds - 1,
        "kvtier_set_gbps": kvtier["set_gbps"], "kvtier_get_gbps": kvtier["get_gbps"],
        "file_set_gbps": file["set_gbps"], "file_get_gbps": file["get_gbps"],
        "copy_set_gbps": copy_set, "copy_get_gbps": copy_get,
        "copy_hot_set_gbps": hot_set, "copy_hot_get_gbps": hot_get,
        "set_vs_file": kvtier["set_gbps"] / file["set_gbps"],
        "get_vs_file": kvtier["get_gbps"] / file["get_gbps"],
        "set_vs_copy": kvtier["set_gbps"] / copy_set,
        "get_vs_copy": kvtier["get_gbps"] / copy_get,
        "set_vs_copy_hot": kvtier["set_gbps"] / hot_set,
        "get_vs_copy_hot": kvtier["get_gbps"] / hot_get,
    }


if __name__ == "__main__":
    main()
