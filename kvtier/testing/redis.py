"""Real Redis servers on loopback to test the remote tier against: one server, or a three-shard
cluster.

Servers come from Debian's `redis-server` (`.ci/run` installs it). Readiness is read from the
server's own log line, not guessed with sleeps; each server lives in its own directory and is
stopped by whoever started it (the `redis_server` and `redis_cluster` fixtures of
`kvtier.testing.fixtures`, a benchmark), its files removed with the directory; and killed by
`kvtier.testing.reaper` if that process dies first (a killed or timed-out test run).

Verbs: `RedisServer.start` / `stop` / `cli`, `RedisCluster.start` / `restart` / `wait_ok` /
`stop`, `shard_key_counts`, `free_port`, `redis_required`.
"""

from __future__ import annotations

import os
import queue
import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from kvtier.testing import reaper

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
READY_LINE = "Ready to accept connections"
# The remote round-trip timeout of the tests' tiers and daemons: a loopback round trip takes well
# under a millisecond, but on a busy machine (2 cores, other load) one may wait seconds for a
# core, and a timeout takes the tier offline. Tests of outages bound their timings by a fraction
# of it: an offline tier answers without waiting for any round trip.
ROUND_TRIP_TIMEOUT_S = 10.0
OFFLINE_ANSWER_BOUND_S = ROUND_TRIP_TIMEOUT_S / 10


def _program(path: str | None, name: str) -> str:
    """`path`, the program's place on the PATH; callers check REDIS_SERVER / REDIS_CLI first."""
    if path is None:
        raise RuntimeError(f"{name} is not installed (Debian package redis-server)")
    return path


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A loopback TCP port nobody listens on now; for a cluster node, one whose bus port
    (port + 10000, which must stay below 65536) is free too."""
    if not cluster:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One `redis-server` process on 127.0.0.1:`port`, data and log in `workdir`."""

    def __init__(self, workdir: Path, port: int | None = None, cluster: bool = False,
                 tls: bool = False, cert_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.cert_dir = cert_dir or workdir  # cert.pem and key.pem (shared by a cluster's shards)
        self.port = port or free_port(cluster)
        self.cluster = cluster
        self.tls = tls  # TLS only, with a self-signed certificate made in `workdir`
        self.process: subprocess.Popen[str] | None = None
        self._pump: threading.Thread | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """The server's redis:// URL (rediss://, trusting its certificate, with `tls`)."""
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert_dir / 'cert.pem'}"
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the server and return once it logged that it accepts connections."""
        args = [_program(REDIS_SERVER, "redis-server"), "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.workdir), "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--logfile", ""]
        if self.tls:
            self._make_certificate()
            args[1:3] = ["--port", "0", "--tls-port", str(self.port),
                         "--tls-cert-file", str(self.cert_dir / "cert.pem"),
                         "--tls-key-file", str(self.cert_dir / "key.pem"),
                         "--tls-ca-cert-file", str(self.cert_dir / "cert.pem"),
                         "--tls-auth-clients", "no"]
            if self.cluster:
                args += ["--tls-cluster", "yes"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        reaper.watch(self.process.pid)  # killed even if this process dies before `stop`
        lines: queue.Queue[str | None] = queue.Queue()
        self._pump = threading.Thread(target=_pump, args=(self.process, lines), daemon=True)
        self._pump.start()
        seen: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"redis-server not ready in {timeout_s} s:\n"
                                   f"{''.join(seen)}") from None
            if line is None:
                raise RuntimeError(f"redis-server exited before it was ready:\n{''.join(seen)}")
            seen.append(line)
            if READY_LINE in line:
                return

    def _make_certificate(self) -> None:
        if (self.cert_dir / "cert.pem").exists():
            return
        self.cert_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", str(self.cert_dir / "key.pem"),
                        "-out", str(self.cert_dir / "cert.pem"), "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"],
                       capture_output=True, timeout=60, check=True)

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, the worst case) and reap it."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait(10)
        if self._pump is not None:
            self._pump.join(10)  # EOF once the server is gone
        if process.stdout is not None:
            process.stdout.close()

    def cli(self, *args: str) -> str:
        """Run one redis-cli command against this server; its output."""
        return subprocess.run([_program(REDIS_CLI, "redis-cli"), "-h", "127.0.0.1",
                               "-p", str(self.port), *self.cli_tls_args(), *args],
                              capture_output=True, text=True, timeout=30, check=True).stdout

    def cli_tls_args(self) -> list[str]:
        """redis-cli's flags to reach this server."""
        return ["--tls", "--cacert", str(self.cert_dir / "cert.pem")] if self.tls else []


def _pump(process: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    """Forward the server's log lines (None at exit); keeps its pipe from filling up."""
    assert process.stdout is not None  # started with stdout=PIPE
    for line in process.stdout:
        lines.put(line)
    lines.put(None)


class RedisCluster:
    """Three masters, no replicas, hash slots split evenly; shards restartable one by one."""

    def __init__(self, workdir: Path, num_shards: int = 3, tls: bool = False) -> None:
        self.shards = [RedisServer(workdir / f"shard{i}", cluster=True, tls=tls,
                                   cert_dir=workdir / "tls") for i in range(num_shards)]

    @property
    def url(self) -> str:
        """Comma-separated seed URLs: kvtier's cluster form."""
        return ",".join(shard.url for shard in self.shards)

    def start(self) -> None:
        """Start every shard, create the cluster and wait until each shard reports it ok."""
        for shard in self.shards:
            shard.start()
        subprocess.run([_program(REDIS_CLI, "redis-cli"), *self.shards[0].cli_tls_args(),
                        "--cluster", "create",
                        *[f"127.0.0.1:{s.port}" for s in self.shards], "--cluster-yes"],
                       capture_output=True, text=True, timeout=60, check=True)
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Ask each live shard for `cluster info` until all say cluster_state:ok."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [s.cli("cluster", "info") for s in self.shards if s.process is not None]
            if all("cluster_state:ok" in state for state in states):
                return
            if time.monotonic() > deadline:  # each round asks every shard: no sleep needed
                raise RuntimeError(f"cluster not ok after {timeout_s} s: {states}")

    def restart(self, index: int) -> None:
        """Kill shard `index` and start it again on the same port (its slots come back empty)."""
        shard = self.shards[index]
        shard.stop()
        shard.start()
        self.wait_ok()

    def stop(self) -> None:
        """Stop every shard."""
        for shard in self.shards:
            shard.stop()


def shard_key_counts(cluster: RedisCluster) -> list[int]:
    """How many keys each shard holds."""
    return [int(s.cli("dbsize").strip() or 0) for s in cluster.shards]


def redis_required() -> bool:
    """CI sets KVTIER_REQUIRE_REDIS=1: there a missing redis-server fails instead of skipping."""
    return os.environ.get("KVTIER_REQUIRE_REDIS") == "1"
