"""SGLang's real HiCache controller on CPU tensors, driven over stdin: what tests and bench run.

SGLang's engine needs CUDA, but its device and host KV pools, its `HiCacheController` (with its
prefetch, backup and sync threads, the TP minimum-reduce over gloo) and its storage-backend
loader run on CPU. `python -m kvtier.integrations.sglang.driver [--tp-rank R --tp-size N
--dist-port P]` joins a gloo world of N processes, loads SGLang's plugins (kvtier's among them),
prints READY, then answers one JSON command per stdin line with `RESULT <json>`:

- `{"open": {"backend": "kvtier"|"file", "layout": ..., "socket": ..., "file_dir": ...,
  "model": ..., "pages": n, "layers": l, "heads": h, "dim": d, "page_size": p}}`: build the
  pools and a controller with that storage backend (closing the previous one).
- `{"backup": {"seed": s, "num_pages": n}}`: fill n host pages with bytes of seed s (and this
  rank), back them up under the page hashes of tokens of seed s; the tokens SGLang completed.
- `{"prefetch": {"seed": s, "num_pages": n, "pause": bool}}`: SGLang's hit query, then the
  transfer into fresh host pages (after a `{"go": true}` line when paused: a test acts between;
  `forget_pages` are deleted from the daemon at that point, through `socket`);
  the hit and completed tokens, and whether the landed bytes are the seed's.
  `fault_failure` / `fault_delay_s` turn on SGLang's own fault injection for that controller.
- `{"fill_random": {}}`, `{"plain_copy": {"num_pages": n, "rounds": r, "rotate": b}}`: for the
  benchmark.
- `{"stats": true}`: the backend's `get_stats()` and the errors SGLang's threads logged.
Stdin closed: the controller stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TOKEN_VOCAB = 32000


@dataclass(slots=True)
class _Allocator:
    """The three methods of SGLang's device allocator that the controller calls."""

    kvcache: Any

    def get_kvcache(self) -> Any:
        return self.kvcache

    def set_hicache_transfer_done_event(self, event: Any) -> None:
        pass


class _ErrorLog(logging.Handler):
    """Counts what SGLang logs at ERROR (its threads log the exceptions they swallow)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:300])


class Driver:
    """One SGLang rank's pools and controller."""

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.controller: Any = None
        self.host: Any = None
        self.page_size = 0
        self.errors = _ErrorLog()
        logging.getLogger("sglang").addHandler(self.errors)
        threading.excepthook = self._thread_died
        self.thread_deaths: list[str] = []

    def _thread_died(self, args: threading.ExceptHookArgs) -> None:
        self.thread_deaths.append(f"{args.thread.name if args.thread else '?'}: "
                                  f"{args.exc_type.__name__}: {args.exc_value}")

    def open(self, backend: str, layout: str = "page_first", socket: str = "",
             file_dir: str = "", model: str = "toy-model", pages: int = 64, layers: int = 4,
             heads: int = 2, dim: int = 64, page_size: int = 16,
             fault_failure: float = 0.0, fault_delay_s: float = 0.0) -> dict:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        self.close()
        for name, value in (("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", fault_failure),
                            ("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", fault_delay_s)):
            if value:  # SGLang's own fault injection, wrapping whatever backend it loads
                os.environ[name] = str(value)
            else:
                os.environ.pop(name, None)
        device = MHATokenToKVPool(pages * page_size, page_size, torch.bfloat16, heads, dim,
                                  layers, "cpu", False, start_layer=0, end_layer=layers)
        extra: dict[str, Any]
        if backend == "kvtier":
            extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                     "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "socket": socket,
                     "reconnect_s": 0.05, "timeout_s": 30}
            storage, allocator_type = "dynamic", "kvtier"
        else:
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = file_dir
            extra, storage, allocator_type = {}, "file", "default"
        # SGLang keeps 10 GiB of RAM free beside its host pools; a busy 24 GiB test machine
        # may have less to spare, and these pools are a few MiB: book them against 1 TiB.
        with host_memory_budget_scope(1 << 40):
            self.host = MHATokenToKVPoolHost(
                device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                pin_memory=False, device="cpu", allocator_type=allocator_type,
                device_capacity_tokens=device.size, start_layer=0, end_layer=layers)
        self.page_size = page_size
        self.controller = HiCacheController(
            _Allocator(device), self.host, page_size, dist.group.WORLD, threading.Event(),
            write_policy="write_through", io_backend="direct", storage_backend=storage,
            model_name=model, storage_backend_extra_config=extra, enable_storage_metrics=True)
        return {"backend": type(self.controller.storage_backend).__name__,
                "zero_copy": self.controller.page_get_func.__name__ == "_page_get_zero_copy"}

    def _tokens(self, seed: int, num_pages: int) -> list[int]:
        """The seed's prompt: page i's tokens depend on (seed, i) only, so a shorter prompt of
        the same seed is a prefix of a longer one."""
        return [token for page in range(num_pages) for token in torch.randint(
            1, TOKEN_VOCAB, (self.page_size,),
            generator=torch.Generator().manual_seed(seed * 4096 + page)).tolist()]

    def _page_bytes(self, seed: int, num_pages: int) -> torch.Tensor:
        """The seed's bytes of its first `num_pages` pages on this rank, one int16 row per page
        as SGLang's `get_data_page` reads it (random bf16 patterns include NaNs: compare as
        integers)."""
        numel = self.host.get_dummy_flat_data_page().numel()
        return torch.stack([torch.randint(
            -(1 << 15), 1 << 15, (numel,), dtype=torch.int16,
            generator=torch.Generator().manual_seed((seed * 4096 + page) * 64 + self.tp_rank))
            for page in range(num_pages)])

    def _write_pages(self, host_indices: torch.Tensor, data: torch.Tensor) -> None:
        for page, values in enumerate(data):
            index = int(host_indices[page * self.page_size])
            self.host.set_from_flat_data_page(index, values.view(self.host.dtype))

    def _read_pages(self, host_indices: torch.Tensor, num_pages: int) -> torch.Tensor:
        return torch.stack([
            self.host.get_data_page(int(host_indices[p * self.page_size]), flat=True)
            .contiguous().view(torch.int16) for p in range(num_pages)])

    def backup(self, seed: int, num_pages: int, fill: bool = True) -> dict:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        tokens = self._tokens(seed, num_pages)
        host_indices = self.host.alloc(num_pages * self.page_size)
        if fill:
            self._write_pages(host_indices, self._page_bytes(seed, num_pages))
        hashes = get_storage_hash_str(tokens, None, page_size=self.page_size)
        started = time.perf_counter()
        self.controller.write_storage(host_indices, tokens, hash_value=hashes)
        done = self.controller.ack_backup_queue.get(timeout=120)
        elapsed = time.perf_counter() - started
        self.host.free(host_indices)
        return {"completed_tokens": done.completed_tokens, "seconds": elapsed}

    def prefetch(self, seed: int, num_pages: int, pause: bool = False,
                 forget_pages: tuple[int, ...] = (), socket: str = "",
                 verify: bool = True) -> dict:
        tokens = self._tokens(seed, num_pages)
        started = time.perf_counter()
        operation = self.controller.prefetch(f"req-{seed}-{time.monotonic_ns()}", tokens)
        hit = self.controller.prefetch_hit_queue.get(timeout=120)
        assert hit is operation
        hit_tokens = operation.storage_hit_count
        if pause:
            print("PAUSED", flush=True)
            sys.stdin.readline()
        if forget_pages:  # deleted from the daemon after SGLang's hit query found them
            self._forget(socket, [operation.hash_value[page] for page in forget_pages])
        completed, identical, elapsed = 0, None, 0.0
        if hit_tokens:
            operation.host_indices = self.host.alloc(hit_tokens)
            self.controller.prefetch_buffer.put(operation)
            while True:
                ack = self.controller.ack_prefetch_queue.get(timeout=120)
                if ack.completed_tokens is not None:
                    completed = ack.completed_tokens
                if ack.completed_req:
                    break
            elapsed = time.perf_counter() - started
            landed = completed // self.page_size
            if landed and verify:
                expected = self._page_bytes(seed, landed)
                identical = bool(torch.equal(self._read_pages(operation.host_indices, landed),
                                             expected))
            self.host.free(operation.host_indices)
        return {"hit_tokens": hit_tokens, "completed_tokens": completed,
                "identical": identical, "seconds": elapsed}

    def fill_random(self, seed: int = 0) -> dict:
        """Random bytes in the whole host pool (for the benchmark: pages worth copying)."""
        view = self.host.kv_buffer.view(torch.int16)
        view.copy_(torch.randint(-(1 << 15), 1 << 15, view.shape, dtype=torch.int16,
                                 generator=torch.Generator().manual_seed(seed)))
        return {}

    def plain_copy(self, num_pages: int, rounds: int, rotate: bool = False) -> dict:
        """Seconds of a plain copy of `num_pages` host pages' bytes out to a separate buffer
        and back (the machine's own limit for what a backup and a prefetch move), per round.

        `rotate`: each round's pages and buffer are new ones, as the bench's kvtier rounds' are
        (SGLang's allocator hands out host pages in turn, the daemon stores each round's pages
        in new slots), so the bytes come from memory as theirs do; otherwise the same pages and
        buffer every round, whose bytes a large last-level cache keeps (300 MiB here)."""
        flat = self.host.kv_buffer.view(torch.uint8).reshape(2, -1)
        span_bytes = flat.shape[1] * num_pages // self.host.page_num
        num_spans = flat.shape[1] // span_bytes if rotate else 1
        others = torch.empty((rounds if rotate else 1, 2, span_bytes), dtype=torch.uint8)
        others.fill_(1)  # faulted in, as the daemon's arena is
        out, back = [], []
        for index in range(rounds):
            start = (index % num_spans) * span_bytes
            span = flat[:, start : start + span_bytes]
            other = others[index % len(others)]
            started = time.perf_counter()
            other.copy_(span)
            out.append(time.perf_counter() - started)
            started = time.perf_counter()
            span.copy_(other)
            back.append(time.perf_counter() - started)
        return {"out_s": out, "back_s": back, "bytes": span_bytes * 2}

    def _forget(self, socket: str, sglang_keys: list[str]) -> None:
        from kvtier.client import Client
        from kvtier.integrations.sglang.geometry import page_key

        with Client(socket or None, "sglang-test-forget") as client:
            handle = client.open_namespace(self.controller.storage_backend.namespace)
            client.delete(handle, [page_key(key) for key in sglang_keys])

    def stats(self) -> dict:
        metrics = self.controller.storage_backend.get_stats()
        return {"prefetch_pgs": list(getattr(metrics, "prefetch_pgs", [])),
                "backup_pgs": list(getattr(metrics, "backup_pgs", [])),
                "prefetch_gbps": list(getattr(metrics, "prefetch_bandwidth", [])),
                "backup_gbps": list(getattr(metrics, "backup_bandwidth", [])),
                "errors": self.errors.messages, "thread_deaths": self.thread_deaths}

    def close(self) -> None:
        if self.controller is not None:
            self.controller.detach_storage_backend()
            self.controller = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dist-port", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[rank {args.tp_rank}] %(levelname)s %(name)s: %(message)s")
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel

    port = args.dist_port or _free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=args.tp_rank, world_size=args.tp_size)
    get_parallel().override_permanently(tp_rank=args.tp_rank, tp_size=args.tp_size, pp_rank=0,
                                        pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    load_plugins()  # as SGLang's scheduler does: kvtier's entry point is among them
    driver = Driver(args.tp_rank, args.tp_size)
    print("READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        verb, params = next(iter(command.items()))
        try:
            result = driver.stats() if verb == "stats" else getattr(driver, verb)(**params)
        except Exception as exc:  # a refused attach: the test reads why
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print("RESULT " + json.dumps(result), flush=True)
    driver.close()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


if __name__ == "__main__":
    main()
