"""A vLLM engine driven over stdin and stdout: try the connector by hand, test it, time it.

    python -m kvtier.integrations.vllm.driver --model DIR [--build-model] [--socket PATH]
        [--no-kvtier] [--no-prefix-caching] [--multiprocess] [--blocks N]

Starts one offline `vllm.LLM` (with the kvtier connector unless `--no-kvtier`), prints `READY`,
then answers one JSON command per stdin line with one `RESULT {json}` line on stdout (vLLM's own
log goes to stdout too, so read only lines starting with `RESULT`):

- `{"prompts": [[token ids], ...], "max_tokens": 8}`: greedy generation, one prompt at a time
  (`"together": true`: all in one batch, as concurrent requests; `max_tokens` may be a list, one
  per prompt, so that a batch's requests end at different steps; `"with_preemptions": true`
  appends `{"preemptions": N}`, vLLM's count of preempted requests so far);
  the result has, per prompt, the generated `tokens`, `cached` (prompt tokens vLLM did not
  compute: its own prefix cache and kvtier's pages together) and `seconds` (the whole call; with
  `max_tokens` 1 that is the time to first token).
- `{NAME: value}`, for a NAME the caller of `main` added to `commands`: that command, given the
  driver's arguments and the value; its result. `kvtier.testing.vllm_driver` adds fault
  injection for tests this way.

`--build-model` writes a small random-weight Llama (seeded, no download) to `--model` first when
the folder holds none; prompts are token ids, so no tokenizer is needed. Its weights are drawn
wide enough that greedy outputs are not degenerate (see `build_model`).

`DriverProcess` is the other end, for programs that start engines (tests, benchmarks): it runs
the driver (this module, or one that calls `main` with more commands) in a Python that has vLLM
and speaks this protocol. Verbs: `main`, `build_model`, `DriverProcess`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# A command a program driving the engine adds: the driver's arguments and the command's value
# in, its result (JSON) out.
Command = Callable[[argparse.Namespace, Any], Any]
DRIVER_MODULE = "kvtier.integrations.vllm.driver"


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvtier.integrations.vllm.driver",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (Hugging Face format)")
    parser.add_argument("--build-model", default="",
                        help="build a random-weight Llama there first: "
                             "'LAYERS,HIDDEN,HEADS,KV_HEADS'")
    parser.add_argument("--socket", default="", help="the kvtier daemon's socket")
    parser.add_argument("--no-kvtier", action="store_true", help="plain vLLM, no connector")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn vLLM's own prefix cache off")
    parser.add_argument("--multiprocess", action="store_true",
                        help="vLLM's multi-process mode (scheduler and worker apart)")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per vLLM block")
    parser.add_argument("--blocks", type=int, default=256, help="KV cache blocks")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="longest request (at most what --blocks hold, "
                             "one being vLLM's null block)")
    parser.add_argument("--extra-config", default="{}",
                        help="more kv_connector_extra_config, as JSON")
    return parser.parse_args(argv)


def build_model(folder: str, spec: str, seed: int = 0) -> None:
    """Save a random-weight Llama `LAYERS,HIDDEN,HEADS,KV_HEADS` to `folder` unless one is there.

    Weights are drawn with std 0.05, not Hugging Face's 0.02: at 0.02 an 8-layer model's greedy
    outputs collapse onto a few tokens repeated (9 distinct over 12 prompts x 8 tokens), so a
    test comparing tokens could not tell right KV from wrong; at 0.05 they are ~90 distinct and
    depend on the whole prompt.
    """
    if os.path.exists(os.path.join(folder, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    num_layers, hidden, num_heads, num_kv_heads = (int(part) for part in spec.split(","))
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=8192,
                         initializer_range=0.05)
    LlamaForCausalLM(config).save_pretrained(folder)


def _preemptions(llm: Any) -> int:
    """Requests vLLM has preempted so far (its own counter)."""
    return int(sum(getattr(metric, "value", 0) for metric in llm.get_metrics()
                   if metric.name == "vllm:num_preemptions"))


def main(argv: list[str] | None = None, commands: Mapping[str, Command] | None = None) -> None:
    """Run the driver (see the module docstring) on `argv` (default: the command line), with
    `commands` answered beside generation."""
    commands = commands or {}
    args = _arguments(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.build_model:
        build_model(args.model, args.build_model)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    transfer = None
    if not args.no_kvtier:
        extra = {"socket": args.socket, **json.loads(args.extra_config)}
        transfer = {"kv_connector": "KvtierConnector",
                    "kv_connector_module_path": "kvtier.integrations.vllm",
                    "kv_role": "kv_both", "kv_connector_extra_config": extra}
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, block_size=args.block_size,
              skip_tokenizer_init=True, max_num_seqs=4,
              max_model_len=min(args.max_model_len, (args.blocks - 1) * args.block_size),
              num_gpu_blocks_override=args.blocks, kv_transfer_config=transfer,
              enable_prefix_caching=not args.no_prefix_caching, disable_log_stats=False)
    print("READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        added = [name for name in command if name in commands]
        if added:
            print("RESULT " + json.dumps(commands[added[0]](args, command[added[0]])), flush=True)
            continue
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in command["prompts"]]
        max_tokens = command.get("max_tokens", 8)
        if not isinstance(max_tokens, list):
            max_tokens = [max_tokens] * len(prompts)
        if len(max_tokens) != len(prompts):  # zip would drop the prompts past the shorter list
            raise ValueError(f"max_tokens lists {len(max_tokens)} counts for {len(prompts)} "
                             f"prompts")
        params = [SamplingParams(max_tokens=n, temperature=0, detokenize=False)
                  for n in max_tokens]
        batches = ([list(zip(prompts, params))] if command.get("together")
                   else [[pair] for pair in zip(prompts, params)])
        results = []
        for batch in batches:
            started = time.perf_counter()
            outputs = llm.generate([prompt for prompt, _ in batch],
                                   [param for _, param in batch], use_tqdm=False)
            results += [{"tokens": list(output.outputs[0].token_ids),
                         "cached": output.num_cached_tokens or 0,
                         "seconds": time.perf_counter() - started} for output in outputs]
        if command.get("with_preemptions"):
            results.append({"preemptions": _preemptions(llm)})
        print("RESULT " + json.dumps(results), flush=True)


class DriverProcess:
    """One engine: the driver started in `python` (an interpreter with vLLM), in `workdir`.

    Args:
        python: the interpreter; run from outside the repository so the source tree does not
            shadow the installed kvtier.
        args: the driver's arguments.
        module: the driver to run (`python -m module`): this one, or one that adds commands.
        start_timeout_s, call_timeout_s: how long `wait_ready` and each command may take.
    """

    def __init__(self, python: Path, args: list[str], workdir: Path,
                 start_timeout_s: float = 600.0, call_timeout_s: float = 300.0,
                 module: str = DRIVER_MODULE) -> None:
        self.process = subprocess.Popen(
            [str(python), "-m", module, *args], cwd=workdir,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1)
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = call_timeout_s
        self._lines: list[str] = []
        self._protocol: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.append(line)
            if line.startswith(("READY", "RESULT ")):
                self._protocol.put(line)
        self._protocol.put(None)

    def log(self, num_lines: int = 200) -> str:
        """The engine's last output lines (vLLM's log and the protocol)."""
        return "".join(self._lines[-num_lines:])

    def _next(self, timeout_s: float) -> str:
        try:
            line = self._protocol.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the vLLM engine did not answer in {timeout_s} s:\n"
                               f"{self.log()}") from None
        if line is None:
            raise RuntimeError(f"the vLLM engine exited ({self.process.wait()}):\n{self.log()}")
        return line

    def wait_ready(self) -> DriverProcess:
        """Return once the engine is up.

        Raises:
            RuntimeError: it exited first; TimeoutError: it took too long.
        """
        self._next(self._start_timeout_s)
        return self

    def send(self, command: dict) -> Any:
        """One command (see the module docstring); its result."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self._next(self._call_timeout_s).split(" ", 1)[1])

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict]:
        """Greedy generation of each prompt in turn."""
        return self.send({"prompts": prompts, "max_tokens": max_tokens})

    def close(self) -> int:
        """End the engine (stdin closed: it exits); its exit code."""
        assert self.process.stdin is not None and self.process.stdout is not None
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(self._call_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._reader.join(self._call_timeout_s)
        self.process.stdout.close()
        if not self.process.stdin.closed:
            self.process.stdin.close()
        return self.process.wait()


if __name__ == "__main__":
    main()
