"""Soak phase `remote`: two daemons share a loopback redis-server (`kvtier.testing.redis`).

Node a stores rounds of pages (written through to Redis), node b recalls pages it never held,
while Redis is killed and restarted between rounds and bytes of some values are flipped in Redis:
node b must serve no wrong or corrupt page, count every corrupt value as an integrity error, see
every outage and reconnect. Skipped without redis-server.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvtier.config import RemoteConfig
from kvtier.tiers.remote import redis_key
from soak_phases.common import (
    NAMESPACE,
    Figures,
    Pager,
    key_of,
    running_daemon,
    serve_args,
    wait_until,
)


def phase_remote(work: Path, num_outages: int, num_flips: int, rng: random.Random) -> Figures:
    """Two daemons share a Redis; node a stores, node b recalls what it never held, while Redis
    is killed and restarted and some of its values are corrupted."""
    from kvtier.testing import redis as redis_servers

    if redis_servers.REDIS_SERVER is None:
        return {"remote": "skipped: redis-server is not installed"}
    import redis as redis_py

    server = redis_servers.RedisServer(work / "redis")
    server.start()
    figures: Figures = {"outages_caused": 0, "corrupted_values": 0, "corrupt_served": 0,
                        "wrong_pages": 0, "remote_served": 0}
    remote = ("--remote-url", server.url)
    try:
        with running_daemon(work / "ra.sock", *serve_args(work / "ra-disk", "1MiB", "64MiB",
                                                          *remote)) as node_a, \
                running_daemon(work / "rb.sock", *serve_args(work / "rb-disk", "1MiB", "64MiB",
                                                             *remote)) as node_b:
            writer, reader = Pager(node_a.socket_path, "remote-a"), Pager(node_b.socket_path,
                                                                          "remote-b")
            raw = redis_py.Redis.from_url(server.url)
            corrupted: set[bytes] = set()
            try:
                for round_index in range(num_outages + 1):
                    keys = [key_of("remote", round_index, i) for i in range(48)]
                    writer.store(keys)
                    wait_until(lambda: writer.client.stats()["remote"]["pending_bytes"] == 0, 30)
                    for key in rng.sample(keys, num_flips):  # flip one byte of the value
                        name = redis_key(RemoteConfig().key_prefix, NAMESPACE.fingerprint + key)
                        value = bytearray(raw.get(name) or b"")
                        if value:
                            value[rng.randrange(len(value))] ^= 0xFF
                            raw.set(name, bytes(value))
                            corrupted.add(key)
                    served, num_wrong, _ = reader.recall(keys)
                    figures["wrong_pages"] += num_wrong
                    figures["corrupt_served"] += len(served & corrupted)
                    figures["remote_served"] += len(served)
                    if round_index < num_outages:  # kill Redis under traffic, then bring it back
                        server.stop()
                        # Requests that must reach the remote, so both daemons meet the outage:
                        # node b recalls pages nobody stored, node a writes pages through.
                        reader.recall([key_of("absent", round_index, i) for i in range(4)])
                        writer.store([key_of("offline", round_index, i) for i in range(8)])
                        wait_until(lambda: not writer.client.stats()["remote"]["connected"]
                                   and not reader.client.stats()["remote"]["connected"], 30)
                        server.start()
                        raw = redis_py.Redis.from_url(server.url)
                        figures["outages_caused"] += 1
                        wait_until(lambda: reader.client.stats()["remote"]["connected"]
                                   and writer.client.stats()["remote"]["connected"], 30)
                stats_a, stats_b = writer.client.stats(), reader.client.stats()
                figures.update(
                    corrupted_values=len(corrupted),
                    integrity_errors_reported=stats_b["remote"]["integrity_errors"],
                    outages_seen_a=stats_a["remote"]["outages"],
                    outages_seen_b=stats_b["remote"]["outages"],
                    connected_at_end=stats_a["remote"]["connected"]
                    and stats_b["remote"]["connected"],
                    check_problems=len(writer.client.check()) + len(reader.client.check()))
            finally:
                raw.close()
                writer.close()
                reader.close()
    finally:
        server.stop()
    return figures
