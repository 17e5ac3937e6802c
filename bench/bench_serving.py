"""What kvtier buys a vLLM OpenAI server under load: vLLM alone against vLLM + kvtier, side by side.

Run:

    python bench/bench_serving.py [--overflow] [--restart] [--two-servers] [--no-reuse]
        [--repeats 2] [--conversations 4] [--turns 4] [--json] [--plot ttft.png]

No scenario flag: all four. Needs the vLLM environment (`bash .ci/install-vllm`, or
KVTIER_VLLM_PYTHON). Builds the demo's 8-layer model (random weights, no download), starts
`kvtier serve` and `python -m vllm.entrypoints.openai.api_server` servers (`--skip-tokenizer-init`:
prompts are token ids; a 32-token block; `--max-num-seqs 4`; one compute thread each,
`--engine-threads`), and drives them with one streaming client per conversation of the
conversation trace (bench/serving_load.py: its turns, their order and prefix sharing, scaled to
the model). The engine cache holds a third of the workload's blocks, so live conversations
overflow it (2-4x). Scenarios:

- `overflow`: the conversations on one server;
- `restart`: the first half of every conversation's turns, the server stopped and a new one
  started (against the same daemon for kvtier), then the second half, its first turns before
  the rest: `first_turn_ttft_ratio` compares each conversation's first turn on the new server.
  vLLM alone also sends those first turns to the old server before stopping it:
  `first_turn_floor_ratio` is their TTFT there (the engine's own cache holding every earlier
  turn, nothing to load: what no KV cache layer can beat) over the cold server's, valid where
  `kept_first_turn_cached_tokens` shows the cache kept them (`--engine-blocks 256`).
  `first_turns` lists each repeat's first turns per side: conversation, arrival (ms after the
  first), prompt tokens from cache, TTFT (ms);
- `two_servers`: two servers behind round-robin (no prefix affinity), one shared daemon;
- `no_reuse`: the same shapes with every page unique: the connector's pure cost.

Each repeat runs both sides one after the other (alternating which goes first) on fresh token
ids (so no repeat reuses another's pages); figures are medians over repeats. Ratios are
kvtier / vLLM alone. `same_tokens`: every request's greedy tokens equal vLLM alone's.
`--json` prints one object, a key per scenario, and `connector`: from the kvtier servers' logs,
the recalls parked and run before the forward, and the recall bandwidth and step time each
server's parking rule measured; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving_load, beside this file

from serving_load import (  # noqa: E402
    Outcome,
    Server,
    WorkloadShape,
    conversations,
    run_clients,
    stream_completion,
    summarize,
    unique_copy,
)

from kvtier.integrations.vllm.driver import build_model  # noqa: E402
from kvtier.testing.daemon_process import DaemonProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "8,512,8,4"
BLOCK = 32
SIDES = ("vllm", "kvtier")
SCENARIO_HELP = {
    "overflow": "the conversations on one server whose cache they overflow",
    "restart": "half the turns, a new server against the same daemon, the other half",
    "two_servers": "two servers behind round-robin sharing one daemon",
    "no_reuse": "every page unique: what the connector costs when nothing is reused",
}


SCENARIOS = tuple(SCENARIO_HELP)
# What the connector's scheduler logs at a clean stop (kvtier/integrations/vllm/scheduler.py).
PARKED_LINE = re.compile(r"(\d+) recalls parked their requests, (\d+) ran before the forward")
MEASURED_LINE = re.compile(
    r"recalls reached ([0-9.]+) GB/s lately \((\d+) reports\), steps took ([0-9.]+) ms")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Bench:
    """The servers of both sides, the daemon, and the runs of every scenario."""

    def __init__(self, python: Path, root: Path, shape: WorkloadShape, connector: dict,
                 engine_blocks: int = 0, engine_threads: int = 1) -> None:
        self.python, self.root, self.shape, self.connector = python, root, shape, connector
        self.engine_threads = engine_threads
        self.restart_turn = shape.max_turns // 2  # the new server's first turn in `restart`
        self.workload = conversations(shape)
        num_blocks = sum(-(-turns[-1].input_tokens // BLOCK) + 1 for turns in self.workload)
        self.max_model_len = shape.max_input_tokens + shape.max_output_tokens + BLOCK
        # A third of the live conversations' blocks, but room for the longest request and one.
        self.num_blocks = engine_blocks or max(num_blocks // 3, self.max_model_len // BLOCK + 2)
        self.live_to_cache = num_blocks / self.num_blocks
        build_model(str(root / "model"), MODEL)
        self.socket = root / "kvtier.sock"
        self.daemon = DaemonProcess.start(self.socket, "--host-capacity", "1GiB", "--disk-path",
                                          str(root / "disk"), "--no-prefault")
        self.servers: dict[str, list[Server]] = {side: [] for side in SIDES}
        self._num_started = 0

    def launch(self, side: str) -> Server:
        """A new server of `side`, starting (see `Server.wait_ready`)."""
        self._num_started += 1
        return Server(self.python, self.root / "model",
                      self.root / f"server-{self._num_started}-{side}.log", self.num_blocks,
                      BLOCK, self.max_model_len, self.socket if side == "kvtier" else None,
                      self.connector, self.engine_threads)

    def ensure(self, count: int) -> None:
        """At least `count` servers up on each side (started together: a start is slow)."""
        new = {side: [self.launch(side) for _ in range(count - len(self.servers[side]))]
               for side in SIDES}
        for side in SIDES:
            for server in new[side]:
                self.servers[side].append(self._warm(server.wait_ready()))

    def _warm(self, server: Server) -> Server:
        """One short request first (not counted): a new server's first forward is slow."""
        stream_completion(server.port, list(range(1, 3 * BLOCK)), 2, Outcome(-1, -1))
        return server

    def daemon_figures(self) -> dict[str, int]:
        """Lookup hits per tier (the connector's store-skipping lookups count too) and pages
        recalled and stored, so far."""
        with self.daemon.client("bench") as client:
            stats = client.stats()
        figures = {f"hits_{tier['tier']}": tier["hits"] for tier in stats["tiers"]}
        for name in ("pages_recalled", "pages_stored"):
            figures[name] = stats["counters"][name]
        return figures

    def run(self, scenario: str, side: str, seed: int) -> tuple[dict, list[Outcome]]:
        """One run of `scenario` on `side`'s servers: its figures and its requests."""
        workload = unique_copy(self.workload) if scenario == "no_reuse" else self.workload
        before = self.daemon_figures()
        servers = self.servers[side]
        ports = [servers[0].port]
        if scenario == "two_servers":
            ports = [server.port for server in servers[:2]]
        kept: list[Outcome] = []
        if scenario == "restart":
            middle = self.restart_turn
            run_clients(ports, workload, seed, self.shape.page_tokens, slice(0, middle))
            if side == "vllm":  # the floor: these first turns where the engine kept it all
                kept = run_clients(ports, workload, seed, self.shape.page_tokens,
                                   slice(middle, middle + 1))
            servers[0].stop()
            servers[0] = self._warm(self.launch(side).wait_ready())
            ports = [servers[0].port]
            # The new server's first turns as one phase, then the later turns: with the trace's
            # think times compressed, a side that answers some first turns fast would otherwise
            # have their next turns (long prefills) land on its slower first turns, which
            # users' real think times (seconds) keep apart.
            outcomes = run_clients(ports, workload, seed, self.shape.page_tokens,
                                   slice(middle, middle + 1))
            outcomes += run_clients(ports, workload, seed, self.shape.page_tokens,
                                    slice(middle + 1, None))
            outcomes.sort(key=lambda o: (o.conversation, o.turn))
        else:
            outcomes = run_clients(ports, workload, seed, self.shape.page_tokens)
        figures = summarize(outcomes)
        if scenario == "restart":
            first = [o for o in outcomes if o.turn == self.restart_turn]
            figures.update(_first_turns("first_turn", first))
            if kept:
                figures.update(_first_turns("kept_first_turn", kept))
        after = self.daemon_figures()
        figures["daemon"] = {name: after[name] - before[name]
                             for name in after} if side == "kvtier" else {}
        return figures, outcomes

    def close(self) -> None:
        for servers in self.servers.values():
            for server in servers:
                server.stop()
        self.daemon.stop()

    def connector_figures(self) -> dict:
        """How the kvtier servers' recalls ran, from the counts their connectors log (at 16
        recalls, 32, 64, ...; vLLM's server stops its engine without letting it log more):
        recalls parked and run before the forward (each server's last count, summed), and per
        server the recall bandwidth and step time its parking rule measured then."""
        parked = before_forward = 0
        measured = []
        for log_path in sorted(self.root.glob("server-*-kvtier.log")):
            text = log_path.read_text(errors="replace")
            counts = PARKED_LINE.findall(text)
            if counts:
                parked += int(counts[-1][0])
                before_forward += int(counts[-1][1])
            measured += [{"recall_gbps": float(found[0]), "reports": int(found[1]),
                          "step_ms": float(found[2])} for found in MEASURED_LINE.findall(text)[-1:]]
        return {"recalls_parked": parked, "recalls_before_forward": before_forward,
                "measured": measured}


def _first_turns(prefix: str, outcomes: list[Outcome]) -> dict:
    """Mean TTFT of a server's first turns and the prompt tokens its cache served them."""
    return {f"{prefix}_ttft_ms": sum(o.ttft_s for o in outcomes) / len(outcomes) * 1e3,
            f"{prefix}_cached_tokens": sum(o.cached_tokens for o in outcomes)}


def _arrivals(outcomes: list[Outcome]) -> list[list[float]]:
    """Per request, by arrival: [conversation, ms after the first arrived, prompt tokens the
    cache served, TTFT ms]."""
    first = min(o.start_s for o in outcomes)
    return [[o.conversation, round((o.start_s - first) * 1e3), o.cached_tokens,
             round(o.ttft_s * 1e3, 1)] for o in sorted(outcomes, key=lambda o: o.start_s)]


def _medians(runs: list[dict]) -> dict:
    result: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            result[key] = {k: median(run[key].get(k, 0) for run in runs) for k in value}
        else:
            result[key] = round(median(run[key] for run in runs), 3)
    return result


def run_scenario(bench: Bench, scenario: str, repeats: int, base_seed: int) -> dict:
    bench.ensure(2 if scenario == "two_servers" else 1)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    same_tokens = True
    per_turn: dict[str, dict[int, list[float]]] = {side: {} for side in SIDES}
    first_turns: dict[str, list[list[list[float]]]] = {side: [] for side in SIDES}
    for repeat in range(repeats):
        seed = base_seed + 1000 * SCENARIOS.index(scenario) + repeat
        tokens: dict[str, list[list[int]]] = {}
        for side in (SIDES if repeat % 2 == 0 else SIDES[::-1]):
            _progress(f"{scenario}: repeat {repeat + 1}/{repeats}, {side} ...")
            figures, outcomes = bench.run(scenario, side, seed)
            runs[side].append(figures)
            tokens[side] = [o.tokens for o in outcomes]
            for o in outcomes:
                per_turn[side].setdefault(o.turn, []).append(o.ttft_s * 1e3)
            if scenario == "restart":
                first_turns[side].append(_arrivals(
                    [o for o in outcomes if o.turn == bench.restart_turn]))
        same_tokens &= tokens["vllm"] == tokens["kvtier"]
    result = {side: _medians(runs[side]) for side in SIDES}
    result["same_tokens"] = same_tokens
    result["ttft_per_turn_ms"] = {side: {turn: round(sum(v) / len(v), 1)
                                         for turn, v in sorted(per_turn[side].items())}
                                  for side in SIDES}
    plain, kvtier = result["vllm"], result["kvtier"]
    result["ttft_mean_ratio"] = round(kvtier["ttft_mean_ms"] / plain["ttft_mean_ms"], 3)
    result["throughput_ratio"] = round(kvtier["output_tokens_per_s"]
                                       / plain["output_tokens_per_s"], 3)
    if scenario == "restart":
        result["first_turn_ttft_ratio"] = round(kvtier["first_turn_ttft_ms"]
                                                / plain["first_turn_ttft_ms"], 3)
        # What no KV cache layer can beat: the old engine still holding every earlier turn
        result["first_turn_floor_ratio"] = round(plain["kept_first_turn_ttft_ms"]
                                                 / plain["first_turn_ttft_ms"], 3)
        result["first_turns"] = first_turns
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in SCENARIOS if name in report]
    figure, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for axis, name in zip(axes[0], names):
        for side, label in (("vllm", "vLLM alone"), ("kvtier", "vLLM + kvtier")):
            series = report[name]["ttft_per_turn_ms"][side]
            turns = [int(t) + 1 for t in series]
            axis.plot(turns, list(series.values()), marker="o", label=label)
            axis.set_xticks(turns)
        axis.set_title(name)
        axis.set_xlabel("turn")
        axis.set_ylabel("TTFT mean (ms)")
        axis.set_ylim(bottom=0)
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _table(report: dict) -> str:
    rows = ["| scenario | side | req/s | out tok/s | TTFT mean | p50 | p90 | p99 | ITL p50 | "
            "p99 | cached prompt tokens | pages recalled (host hits) |", "|---" * 12 + "|"]
    for name in SCENARIOS:
        if name not in report:
            continue
        for side in SIDES:
            f = report[name][side]
            daemon = f["daemon"]
            hits = (f"{int(daemon['pages_recalled'])} ({int(daemon['hits_host'])})"
                    if daemon else "-")
            rows.append(f"| {name} | {side} | {f['requests_per_s']:.2f} | "
                        f"{f['output_tokens_per_s']:.1f} | {f['ttft_mean_ms']:.0f} | "
                        f"{f['ttft_p50_ms']:.0f} | {f['ttft_p90_ms']:.0f} | "
                        f"{f['ttft_p99_ms']:.0f} | {f['itl_p50_ms']:.0f} | {f['itl_p99_ms']:.0f} | "
                        f"{int(f['prefix_tokens_cached'])} | {hits} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, help_text in SCENARIO_HELP.items():
        parser.add_argument("--" + name.replace("_", "-"), action="store_true",
                            help=help_text + " (no scenario flag: all four)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each side, interleaved; figures are medians (default 2)")
    parser.add_argument("--conversations", type=int, default=4,
                        help="concurrent conversations, one streaming client each (default 4)")
    parser.add_argument("--turns", type=int, default=4,
                        help="turns per conversation, at most (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    parser.add_argument("--connector", default="{}", help="kv_connector_extra_config, as JSON")
    parser.add_argument("--engine-blocks", type=int, default=0,
                        help="each server's KV cache blocks (default: a third of the workload's)")
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="each engine's compute threads (OMP_NUM_THREADS; default 1: on 2 "
                             "cores a second one competes with the server's other processes "
                             "and vLLM alone's TTFT swings 0.6-1.0 s run to run)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--plot", default="", help="write TTFT per turn (PNG) here")
    args = parser.parse_args()
    chosen = [name for name in SCENARIOS if getattr(args, name)] or list(SCENARIOS)
    python = Path(os.environ.get("KVTIER_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        parser.error(f"no vLLM environment at {python}: run `bash .ci/install-vllm`")
    shape = WorkloadShape(num_conversations=args.conversations, max_turns=args.turns,
                          min_turns=min(3, args.turns))
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serving-") as scratch:
        bench = Bench(python, Path(scratch), shape, json.loads(args.connector),
                      args.engine_blocks, args.engine_threads)
        try:
            report["workload"] = {
                "conversations": len(bench.workload),
                "requests": sum(len(c) for c in bench.workload),
                "prompt_tokens": [[t.input_tokens for t in c] for c in bench.workload],
                "engine_blocks": bench.num_blocks, "engine_threads": args.engine_threads,
                "live_blocks_to_cache": round(bench.live_to_cache, 2)}
            for name in chosen:
                report[name] = run_scenario(bench, name, args.repeats, args.seed)
        finally:
            bench.close()
        report["connector"] = bench.connector_figures()
    if args.plot:
        plot(report, Path(args.plot))
    if args.json:
        print(json.dumps(report))
        return
    print(json.dumps(report["workload"]))
    print(_table(report))
    for name in chosen:
        ratios = {k: v for k, v in report[name].items() if k.endswith("_ratio")}
        print(f"{name}: same_tokens {report[name]['same_tokens']}, {ratios}")


if __name__ == "__main__":
    main()
