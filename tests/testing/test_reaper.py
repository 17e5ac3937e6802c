"""A test run killed mid-test (SIGKILL, as pytest-timeout's os._exit or an OOM kill; SIGINT, as
Ctrl-C) leaves no redis-server, no daemon and no /dev/shm/kvtier-* segment behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kvtier.shm import SHM_DIR
from kvtier.testing import redis as redis_harness
from kvtier.testing.daemon import readline_within

REPO = Path(__file__).resolve().parents[2]

# A test that starts what the suite's harnesses start, says what it holds, and waits to be killed.
# SIGINT gets Python's own handler back first: a suite started from a background job (`cmd &`
# in a script) inherits SIGINT ignored, Python then leaves it ignored, and the Ctrl-C below would
# never end the run. It waits in short sleeps, not signal.pause(): a SIGINT between the last check
# for signals and pause() would leave pause() waiting for a second one.
HOLDING_TEST = '''
import os, signal, time
from pathlib import Path
from kvtier.shm import SharedSegment, new_segment_name
from kvtier.testing import reaper
from kvtier.testing.daemon import DaemonProcess
from kvtier.testing.redis import RedisServer

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal's run


def test_holds_until_killed(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    daemon = DaemonProcess.start(Path(os.environ["SOCKET_DIR"]) / "d.sock", tmp_path / "disk")
    arena = SharedSegment.create(new_segment_name("kvtier-host"), 4096)
    print("HOLDING", os.getpid(), server.process.pid, daemon.pid, reaper.reaper_pid(),
          arena.name, flush=True)
    while True:
        time.sleep(0.05)
'''


def segments_of(pids: set[int]) -> list[str]:
    return sorted(path.name for path in SHM_DIR.glob("kvtier-*")
                  if len(path.name.split("-")) >= 4 and path.name.split("-")[2] in map(str, pids))


@pytest.mark.skipif(redis_harness.REDIS_SERVER is None and not redis_harness.redis_required(),
                    reason="redis-server is not installed")
@pytest.mark.parametrize("kill_signal", [signal.SIGKILL, signal.SIGINT])
def test_a_killed_run_leaves_no_server_daemon_or_segment(tmp_path: Path, socket_dir: Path,
                                                         kill_signal: signal.Signals) -> None:
    (tmp_path / "test_holding.py").write_text(HOLDING_TEST)
    if True:
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
             "-p", "kvtier.testing.fixtures", str(tmp_path / "test_holding.py")],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "SOCKET_DIR": str(socket_dir)})
        held: set[int] = set()
        owners: set[int] = set()
        try:
            line = ""
            while not line.startswith("HOLDING"):
                line = readline_within(run.stdout, 120)  # type: ignore[arg-type]
                assert line, "the holding test ended before it held anything"
            _, *pid_words, arena = line.split()
            pytest_pid, server_pid, daemon_pid, reaper_pid = map(int, pid_words)
            held = {server_pid, daemon_pid}
            owners = {pytest_pid, daemon_pid}
            assert (SHM_DIR / arena).exists() and segments_of({daemon_pid})
            run.send_signal(kill_signal)
            run.wait(60)
            # The reaper exits once it has reaped: its end is the readiness to check.
            _, alive = psutil.wait_procs([psutil.Process(reaper_pid)], timeout=60)
            assert not alive, "the reaper never finished"
            still_running = [pid for pid in held
                             if psutil.pid_exists(pid)
                             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
            assert not still_running, f"left running: {still_running}"
            assert not segments_of(owners), "segments left in /dev/shm"
        finally:
            if run.poll() is None:
                run.kill()
                run.wait(60)
            run.stdout.close()  # type: ignore[union-attr]
            for pid in held:  # leave nothing behind even when the check failed
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for name in segments_of(held | owners):
                (SHM_DIR / name).unlink(missing_ok=True)
