"""The serving benchmark's parts: the workload from the conversation trace, vLLM OpenAI servers,
and streaming clients. Used by bench/bench_serving.py; see its docstring.

Workload: the conversations of `traces/mooncake_conversation_trace.jsonl` (requests sharing a
second page belong to one conversation: page ids are chained, page 0 is the shared system
prompt), the first `num_conversations` with at least `min_turns` turns, in trace order. Each
512-token trace page becomes `page_tokens` token ids drawn from a seed and the page id, so
requests share exactly the prefixes they share in the trace; input and output lengths are
scaled the same way (outputs clamped to 2..`max_output_tokens`), think gaps by `gap_scale`.
Verbs: `conversations`, `unique_copy`, `Server`, `run_clients`, `summarize`.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_trace.jsonl"
TRACE_PAGE_TOKENS = 512


@dataclass(slots=True, frozen=True)
class Turn:
    """One request of a conversation: its page ids, lengths (model tokens) and think gap."""

    page_ids: tuple[int, ...]
    input_tokens: int
    output_tokens: int
    gap_s: float


@dataclass(slots=True, frozen=True)
class WorkloadShape:
    num_conversations: int = 4
    min_turns: int = 3
    max_turns: int = 4
    page_tokens: int = 32
    max_input_tokens: int = 1024
    max_output_tokens: int = 12
    gap_scale: float = 0.0005  # trace gaps are seconds to minutes: keep their order, not length


def conversations(shape: WorkloadShape) -> list[list[Turn]]:
    """The trace's first conversations of `shape.min_turns` or more turns, scaled to the model."""
    groups: dict[int, list[dict]] = {}
    with TRACE.open() as lines:
        for line in lines:
            row = json.loads(line)
            if len(row["hash_ids"]) > 1:
                groups.setdefault(row["hash_ids"][1], []).append(row)
    chosen = [rows for rows in groups.values() if len(rows) >= shape.min_turns]
    chosen.sort(key=lambda rows: rows[0]["timestamp"])
    scale = shape.page_tokens / TRACE_PAGE_TOKENS
    result = []
    for rows in chosen[:shape.num_conversations]:
        turns = []
        for index, row in enumerate(rows[:shape.max_turns]):
            gap_ms = row["timestamp"] - rows[index - 1]["timestamp"] if index else 0
            turns.append(Turn(tuple(row["hash_ids"]),
                              min(shape.max_input_tokens,
                                  max(2, round(row["input_length"] * scale))),
                              min(shape.max_output_tokens,
                                  max(2, round(row["output_length"] * scale))),
                              gap_ms / 1e3 * shape.gap_scale))
        result.append(turns)
    return result


def unique_copy(workload: list[list[Turn]]) -> list[list[Turn]]:
    """The same shapes with every page id made unique: no request shares a page with another."""
    next_id = 1 << 40
    result = []
    for turns in workload:
        copied = []
        for turn in turns:
            ids = tuple(range(next_id, next_id + len(turn.page_ids)))
            next_id += len(ids)
            copied.append(Turn(ids, turn.input_tokens, turn.output_tokens, turn.gap_s))
        result.append(copied)
    return result


def prompt_tokens(turn: Turn, seed: int, page_tokens: int) -> list[int]:
    """The turn's token ids: each page's drawn from (seed, page id), cut to its input length."""
    tokens: list[int] = []
    for page_id in turn.page_ids:
        if len(tokens) >= turn.input_tokens:
            break
        rng = np.random.default_rng([seed, page_id])
        tokens += rng.integers(1, 4000, page_tokens).tolist()
    while len(tokens) < turn.input_tokens:  # the trace's last page may be longer than its ids
        tokens += np.random.default_rng([seed, len(tokens), 7]).integers(1, 4000, 16).tolist()
    return tokens[:turn.input_tokens]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """One `python -m vllm.entrypoints.openai.api_server` on a free port (kvtier if `socket`)."""

    def __init__(self, python: Path, model: Path, log_path: Path, num_blocks: int,
                 block_tokens: int, max_model_len: int, socket_path: Path | None,
                 connector_config: dict | None = None, engine_threads: int = 1) -> None:
        self.port = free_port()
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--skip-tokenizer-init", "--enforce-eager", "--block-size", str(block_tokens),
                "--num-gpu-blocks-override", str(num_blocks), "--max-model-len",
                str(max_model_len), "--max-num-seqs", "4", "--enable-prompt-tokens-details",
                "--served-model-name", "bench"]
        if socket_path is not None:
            extra = {"socket": str(socket_path), **(connector_config or {})}
            args += ["--kv-transfer-config", json.dumps(
                {"kv_connector": "KvtierConnector",
                 "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
                 "kv_connector_extra_config": extra})]
        # The engine's OpenMP threads: on a small machine a second one shares its core with the
        # API server, the clients and the daemon, and each preemption stalls the whole step.
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": str(engine_threads),
               "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, cwd=log_path.parent)

    def wait_ready(self, timeout_s: float = 1200.0) -> Server:
        """Return once /health answers 200.

        Raises:
            RuntimeError: the server exited first or took longer than `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.process.returncode}):\n"
                                   f"{self.log_path.read_text()[-4000:]}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)  # polling a readiness endpoint: nothing else to wait on
        raise RuntimeError(f"vLLM server not ready in {timeout_s} s:\n"
                           f"{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it."""

    conversation: int
    turn: int
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    start_s: float = 0.0
    end_s: float = 0.0


def stream_completion(port: int, prompt: list[int], max_tokens: int, outcome: Outcome) -> None:
    """One streaming greedy completion; fills `outcome`'s tokens and timings."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                       "min_tokens": max_tokens, "temperature": 0, "stream": True,
                       "return_token_ids": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"completion failed: {response.status} {response.read()[:500]!r}")
    last = started
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        now = time.perf_counter()
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") or []
            if ids:
                if not outcome.tokens:
                    outcome.ttft_s = now - started
                else:
                    outcome.itl_s.append((now - last) / len(ids))
                last = now
                outcome.tokens += ids
        usage = chunk.get("usage")
        if usage and usage.get("prompt_tokens_details"):
            outcome.cached_tokens = usage["prompt_tokens_details"].get("cached_tokens") or 0
    connection.close()
    outcome.start_s, outcome.end_s = started, time.perf_counter()


def run_clients(ports: list[int], workload: list[list[Turn]], seed: int, page_tokens: int,
                turns: slice = slice(None)) -> list[Outcome]:
    """One client per conversation, all at once, each sending its `turns` in order (after its
    think gap); requests go to `ports` round-robin in arrival order, as a router without prefix
    affinity sends them."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = [0]
    errors: list[BaseException] = []

    def converse(index: int, conversation: list[Turn]) -> None:
        try:
            for number, turn in list(enumerate(conversation))[turns]:
                time.sleep(turn.gap_s)  # the user's think time, from the trace
                with lock:
                    port = ports[counter[0] % len(ports)]
                    counter[0] += 1
                outcome = Outcome(index, number)
                stream_completion(port, prompt_tokens(turn, seed, page_tokens),
                                  turn.output_tokens, outcome)
                with lock:
                    outcomes.append(outcome)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=converse, args=(i, c)) for i, c in enumerate(workload)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sorted(outcomes, key=lambda o: (o.conversation, o.turn))


def summarize(outcomes: list[Outcome]) -> dict:
    """Requests/s, output tokens/s, TTFT and inter-token latency percentiles, cached tokens."""
    ttft = np.array([o.ttft_s for o in outcomes]) * 1e3
    itl = np.array([x for o in outcomes for x in o.itl_s] or [0.0]) * 1e3
    span = max(o.end_s for o in outcomes) - min(o.start_s for o in outcomes)
    return {"requests": len(outcomes), "requests_per_s": len(outcomes) / span,
            "output_tokens_per_s": sum(len(o.tokens) for o in outcomes) / span,
            "ttft_mean_ms": float(ttft.mean()), "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p90_ms": float(np.percentile(ttft, 90)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "itl_p50_ms": float(np.percentile(itl, 50)),
            "itl_p99_ms": float(np.percentile(itl, 99)),
            "prefix_tokens_cached": sum(o.cached_tokens for o in outcomes)}
