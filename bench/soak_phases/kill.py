"""Soak phase `kill`: SIGKILL the daemon during sustained write-through stores; check each restart.

A writer thread stores pages (write-through: acknowledged = durable; 1 MiB host, so most pages
live only on disk); once a random number of stores was acknowledged the daemon gets SIGKILL at a
random moment, restarts on the same disk directory and socket, and is checked: `check()` clean,
every acknowledged key found and recalled byte-identical, every key ever attempted either
missing or byte-identical.
"""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path

from kvtier.client import DaemonReplyError
from kvtier.testing.daemon_process import DaemonProcess
from soak_phases.common import Figures, Pager, key_of, serve_args, shm_files


class Writer(threading.Thread):
    """Stores batches of fresh pages until its daemon dies; records what was acknowledged."""

    def __init__(self, socket_path: Path, cycle: int, batch_pages: int) -> None:
        super().__init__(daemon=True)
        self.socket_path = socket_path
        self.cycle = cycle
        self.batch_pages = batch_pages
        self.attempted: list[bytes] = []
        self.acked: list[bytes] = []
        self.failures: dict[bytes, str] = {}
        self.changed = threading.Condition()
        self.ended = False

    def run(self) -> None:
        pager = None
        try:
            pager = Pager(self.socket_path, f"writer-{self.cycle}")
            for batch_index in range(1 << 30):
                keys = [key_of("kill", self.cycle, batch_index, i) for i in range(self.batch_pages)]
                self.attempted += keys
                failed = pager.store(keys)
                with self.changed:
                    self.acked += [k for k in keys if k not in failed]
                    self.failures.update(failed)
                    self.changed.notify_all()
        except (ConnectionError, OSError, TimeoutError, DaemonReplyError):
            pass  # the daemon was killed under us
        finally:
            if pager is not None:
                pager.close()
            with self.changed:
                self.ended = True
                self.changed.notify_all()


def phase_kill(work: Path, num_cycles: int, max_acks: int, rng: random.Random) -> Figures:
    """SIGKILL the daemon during sustained write-through stores; check each restart."""
    socket_path, disk_path = work / "kill.sock", work / "kill-disk"
    args = serve_args(disk_path, "1MiB", "256MiB", "--write-policy", "write-through")
    acked: set[bytes] = set()
    attempted: list[bytes] = []
    figures = {"cycles": num_cycles, "acked_pages": 0, "attempted_pages": 0, "lost_pages": 0,
               "wrong_pages": 0, "check_problems": 0, "verify_problems_unacked": 0,
               "verify_problems_acked": 0, "unacked_present": 0, "store_failures": 0,
               "restart_s_max": 0.0, "leaked_segments": 0}
    killed_pids: list[int] = []
    daemon = DaemonProcess.start(socket_path, *args)
    try:
        for cycle in range(num_cycles):
            writer = Writer(socket_path, cycle, batch_pages=rng.choice((1, 4, 8, 16)))
            writer.start()
            target = rng.randint(4, max_acks)
            with writer.changed:
                writer.changed.wait_for(lambda: len(writer.acked) >= target or writer.ended, 60)
            time.sleep(rng.uniform(0, 0.004))  # a random moment, not a synchronization
            killed_pids.append(daemon.pid)
            daemon.kill()
            writer.join(60)
            acked.update(writer.acked)
            attempted += writer.attempted
            figures["store_failures"] += len(writer.failures)
            started = time.monotonic()
            daemon = DaemonProcess.start(socket_path, *args)
            figures["restart_s_max"] = max(figures["restart_s_max"], time.monotonic() - started)
            pager = Pager(socket_path, "verifier")
            try:
                figures["check_problems"] += len(pager.client.check())
                for problem in pager.client.check(verify_bytes=True):
                    scoped = re.search(r"page ([0-9a-f]{64})", problem)
                    acked_key = scoped is not None and bytes.fromhex(scoped[1])[16:] in acked
                    kind = "acked" if acked_key else "unacked"
                    figures[f"verify_problems_{kind}"] += 1
                served, num_wrong, _ = pager.recall(attempted)
                missing = pager.lookup_missing(sorted(acked))
                figures["lost_pages"] += len(missing | (acked - served))
                figures["wrong_pages"] += num_wrong
                figures["unacked_present"] = len(served - acked)
            finally:
                pager.close()
        figures["final_exit_code"] = daemon.stop(30)
    finally:
        if daemon.running:
            daemon.kill()
    figures["acked_pages"] = len(acked)
    figures["attempted_pages"] = len(attempted)
    figures["leaked_segments"] = sum(len(shm_files(f"kvtier-host-{pid}-")) for pid in killed_pids)
    return figures
