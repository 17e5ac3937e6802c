"""Keep a bench's output in the repository: run it, and write what it printed beside the command
and the machine, so the next run's file shows a regression as a diff.

Run:

    python bench/record.py [--name NAME] [--note TEXT] -- python bench/bench_tiers.py --json

The command must print one JSON object on stdout (every bench's `--json`); its stderr passes
through. Writes `bench/results/NAME.json` (NAME: the bench script's stem by default) as described
in bench/results/README.md: the command, the machine (host name, CPU model, the CPUs this
process may use and the machine has, memory, kernel, Python, the load average before and after),
the checkout's commit, the UTC start time, the run's seconds and the bench's output, pretty-
printed with sorted keys so that a diff lines up figure by figure. Exits with the command's
status and writes nothing when it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_bytes() -> int | None:
    """MemTotal from /proc/meminfo."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def commit() -> str:
    """HEAD of this checkout, with "+changes" when the work tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(load_before: tuple[float, float, float]) -> dict:
    return {"hostname": socket.gethostname(), "cpu": cpu_model(),
            "cpus_usable": len(os.sched_getaffinity(0)), "cpus_online": os.cpu_count(),
            "memory_bytes": memory_bytes(), "kernel": platform.release(),
            "python": platform.python_version(),
            "load_before": [round(load, 2) for load in load_before],
            "load_after": [round(load, 2) for load in os.getloadavg()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", help="the result file's name (default: the script's stem)")
    parser.add_argument("--note", default="", help="a sentence kept with the result")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the bench command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    name = args.name or next((Path(part).stem for part in command if part.endswith(".py")),
                             Path(command[0]).name)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    run_s = time.monotonic() - started
    if done.returncode != 0:
        print(f"{shlex.join(command)} exited with {done.returncode}; nothing written",
              file=sys.stderr)
        return done.returncode
    record = {"command": shlex.join(command), "note": args.note, "machine": machine(load_before),
              "commit": commit(), "started_at": started_at, "run_s": round(run_s, 1),
              "output": json.loads(done.stdout)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(REPO)} ({run_s:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
