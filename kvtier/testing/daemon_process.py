"""Run `kvtier serve` as a child process: the one harness the demo, the benchmarks and the tests
start daemons with.

`DaemonProcess.start` launches the daemon and returns once it logged that it is ready (a thread
drains its stderr, so the child never blocks on a full pipe and the log stays readable); `stop`
sends SIGTERM and returns the exit code. `serve_argv` is the command line, for callers that wrap
it (a resource limit, another interpreter). Verbs: `start`, `wait_ready`, `wait_for_log`,
`wait_exit`, `stop`, `kill`, `client`, `log`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from kvtier.client import Client
from kvtier.daemon.process import READY_MESSAGE
from kvtier.errors import LaunchError
from kvtier.shm import reclaim_orphans


def serve_argv(socket_path: Path, *serve_args: str, isolated: bool = True) -> list[str]:
    """`python [-I] -m kvtier.cli.main serve --socket socket_path *serve_args`.

    `isolated` (-I) runs the installed kvtier: the current directory may be a kvtier source
    tree, whose top-level kvtier/ would shadow the installed package (and cli/ installs as
    kvtier.cli, not there), and PYTHONPATH is ignored. Without it the child imports what this
    process's PYTHONPATH and directory give it: a checkout's own kvtier, as its tests and
    benchmarks want.
    """
    return [sys.executable, *(["-I"] if isolated else []), "-m", "kvtier.cli.main", "serve",
            "--socket", str(socket_path), *serve_args]


class DaemonProcess:
    """One `kvtier serve` child process with its log captured."""

    def __init__(self, socket_path: Path, argv: list[str],
                 env: Mapping[str, str] | None = None) -> None:
        self.socket_path = Path(socket_path)
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, env=env)
        self.log_lines: list[str] = []
        self._new_line = threading.Condition()
        self._log_ended = False
        self._drainer = threading.Thread(target=self._drain_log, daemon=True)
        self._drainer.start()

    @classmethod
    def start(cls, socket_path: Path, *serve_args: str, env: Mapping[str, str] | None = None,
              isolated: bool = True, wait_ready_s: float | None = 60.0) -> DaemonProcess:
        """Start `kvtier serve --socket socket_path *serve_args` (see `serve_argv` for
        `isolated`) with `env` (default: this process's); wait until it is ready.

        Raises:
            LaunchError: it exited or was not ready within `wait_ready_s` (its log attached).
        """
        daemon = cls(socket_path, serve_argv(socket_path, *serve_args, isolated=isolated), env)
        if wait_ready_s is not None:
            daemon.wait_ready(wait_ready_s)
        return daemon

    def _drain_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._new_line:
                self.log_lines.append(line)
                self._new_line.notify_all()
        self.process.stderr.close()
        with self._new_line:
            self._log_ended = True
            self._new_line.notify_all()

    def wait_for_log(self, text: str, timeout_s: float) -> bool:
        """Block until the daemon logged a line containing `text`; False if it ended or timed
        out."""
        with self._new_line:
            self._new_line.wait_for(
                lambda: self._log_ended or any(text in line for line in self.log_lines), timeout_s)
            return any(text in line for line in self.log_lines)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the daemon's ready line; kill it and raise if it ends or times out first.

        Raises:
            LaunchError: it exited or was not ready within `timeout_s` (its log attached).
        """
        if not self.wait_for_log(READY_MESSAGE, timeout_s):
            self.kill()
            raise LaunchError(f"kvtier daemon not ready within {timeout_s} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.process.pid

    @property
    def running(self) -> bool:
        """Whether the process is still alive."""
        return self.process.poll() is None

    def log(self) -> str:
        """Everything the daemon wrote to stderr so far."""
        return "".join(self.log_lines)

    def client(self, name: str = "") -> Client:
        """A new client connected to this daemon."""
        return Client(self.socket_path, client_name=name)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        """The exit code, once the process ended and its log is fully read.

        Raises:
            LaunchError: still running after `timeout_s` (it is killed).
        """
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise LaunchError(f"kvtier daemon still running after {timeout_s} s:\n"
                              f"{self.log()}") from None
        self._drainer.join(timeout_s)
        return code

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit code once the process ended and its log is read.

        Raises:
            LaunchError: still running `timeout_s` after SIGTERM (it is killed).
        """
        if self.running:
            self.process.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout_s)

    def kill(self) -> None:
        """SIGKILL (if running), reap, and remove the shared memory it could not."""
        if self.running:
            self.process.kill()
        self.process.wait()
        reclaim_orphans(("kvtier-host-",))

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.running:
            self.stop()
