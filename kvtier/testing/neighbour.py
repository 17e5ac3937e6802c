"""A neighbour: another engine's client, in a process of its own, pinging a daemon at a steady
pace while a test or a bench attacks it; what one client's load costs the others.

A ping's time counts from when it was due, not from when it was sent: a stall delays every ping
due during it (no coordinated omission), so a stall of a quarter second is a quarter second's
worth of slow pings, not one.

    with Neighbour(socket_path) as neighbour:
        quiet = time.monotonic(); ...; started = time.monotonic(); attack(); ended = ...
    window = neighbour.percentiles(started, ended)
"""

from __future__ import annotations

import json
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from kvtier.client import Client

Sample = tuple[float, float]  # (monotonic end, seconds since the ping was due)


class Neighbour:
    """Pings every `interval_s` from a child process until stopped; `samples` afterwards."""

    def __init__(self, socket_path: Path | str, interval_s: float = 0.005) -> None:
        self.samples: list[Sample] = []
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.testing.neighbour", str(socket_path), str(interval_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != "ready":
            self.__exit__(None, None, None)
            raise RuntimeError(f"the neighbour could not connect to {socket_path}")

    def stop(self) -> list[Sample]:
        """End the pings; every ping's sample (those so far, if the daemon went away)."""
        if self._process.returncode is None:
            assert self._process.stdin is not None and self._process.stdout is not None
            self._process.stdin.close()
            out = self._process.stdout.read()
            self._process.stdout.close()
            self._process.wait()
            self.samples = json.loads(out) if out.strip() else []
        return self.samples

    def window(self, start: float, end: float) -> list[float]:
        """The ping times (seconds) of the pings that ended in [start, end], sorted."""
        return sorted(s for t, s in self.samples if start <= t <= end)

    def percentiles(self, start: float, end: float) -> dict[str, float]:
        """pings, p50_ms, p99_ms, max_ms of the window (just pings: 0 for an empty one)."""
        window = self.window(start, end)
        if not window:
            return {"pings": 0}
        return {"pings": len(window), "p50_ms": round(statistics.median(window) * 1e3, 3),
                "p99_ms": round(p99(window) * 1e3, 3), "max_ms": round(window[-1] * 1e3, 1)}

    def __enter__(self) -> Neighbour:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.stop()
        finally:
            if self._process.returncode is None:
                self._process.kill()
                self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                if pipe is not None:
                    pipe.close()


def p99(window: list[float]) -> float:
    """The 99th percentile of a sorted, non-empty window."""
    return window[min(len(window) - 1, int(len(window) * 0.99))]


def _ping_until_stdin_closes(socket_path: str, interval_s: float) -> None:
    client = Client(socket_path, client_name="neighbour")
    samples: list[Sample] = []
    print("ready", flush=True)
    due = time.monotonic()
    try:
        while not select.select([sys.stdin], [], [], 0)[0]:
            due += interval_s
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            elif pause < -1.0:  # this process itself cannot keep pace (a loaded machine)
                due = time.monotonic()
            client.ping()
            ended = time.monotonic()
            samples.append((ended, ended - due))
    finally:  # the figures so far, even if the daemon went away
        client.close()
        print(json.dumps(samples), flush=True)


if __name__ == "__main__":
    _ping_until_stdin_closes(sys.argv[1], float(sys.argv[2]))
