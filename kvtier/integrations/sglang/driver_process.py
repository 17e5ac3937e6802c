"""One SGLang rank (`kvtier.integrations.sglang.driver`) as a child process: for tests and bench.

Imports neither torch nor SGLang: the child runs in SGLang's environment (`.venv-sglang`), the
caller anywhere. Verbs: `RankProcess` (`wait_ready`, `send`, `call`, `reply`, `log`, `close`).
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any


class RankProcess:
    """The driver started with `python` (an interpreter with SGLang) in `workdir`.

    Args:
        python: the interpreter.
        args: the driver's arguments (`--tp-rank`, `--tp-size`, `--dist-port`).
        workdir: where it runs (outside the repository, so the installed kvtier is used).
        env: its environment.
        timeout_s: how long start-up and each command may take.
    """

    def __init__(self, python: Path, args: list[str], workdir: Path,
                 env: dict[str, str] | None = None, timeout_s: float = 300.0) -> None:
        self.process = subprocess.Popen(
            [str(python), "-m", "kvtier.integrations.sglang.driver", *args], cwd=workdir,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, env=env)
        self.timeout_s = timeout_s
        self._lines: list[str] = []
        self._protocol: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.append(line)
            if line.startswith(("READY", "RESULT ", "PAUSED")):
                self._protocol.put(line)
        self._protocol.put(None)

    def log(self, num_lines: int = 150) -> str:
        """The rank's last output lines."""
        return "".join(self._lines[-num_lines:])

    def _next(self) -> str:
        try:
            line = self._protocol.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the SGLang rank did not answer in {self.timeout_s} s:\n"
                               f"{self.log()}") from None
        if line is None:
            raise RuntimeError(f"the SGLang rank exited ({self.process.wait()}):\n{self.log()}")
        return line

    def wait_ready(self) -> RankProcess:
        """Return once the rank is up (its gloo world joined)."""
        self._next()
        return self

    def send(self, verb: str, **params: Any) -> None:
        """Send one command without waiting (ranks of one world must be sent theirs together)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({verb: params}) + "\n")
        self.process.stdin.flush()

    def reply(self) -> Any:
        """The next command's result (or, after a paused prefetch, the string "PAUSED")."""
        line = self._next()
        return "PAUSED" if line.startswith("PAUSED") else json.loads(line.split(" ", 1)[1])

    def call(self, verb: str, **params: Any) -> Any:
        """One command and its result."""
        self.send(verb, **params)
        return self.reply()

    def close(self) -> int:
        """End the rank (stdin closed: it detaches and exits); its exit code."""
        assert self.process.stdin is not None and self.process.stdout is not None
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._reader.join(self.timeout_s)
        self.process.stdout.close()
        return self.process.wait()
