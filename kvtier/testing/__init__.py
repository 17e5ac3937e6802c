"""Test support: a real daemon and real Redis servers to test against, for kvtier's own suite, its
benchmarks and demo, and engine authors testing their integration; policy drivers for policy
tests.

Nothing here is imported by `import kvtier`; import the module you need:

- `kvtier.testing.daemon_process`: `DaemonProcess`, the one harness that runs `kvtier serve` as a
  child (wait for its ready line, read its log, stop it); the demo and the benchmarks use it.
- `kvtier.testing.daemon`: the suite's `DaemonProcess` on it (a disk tier, the reaper, a check
  that it cleaned up), `wait_until`, `RawConnection` (frames of plain dicts, for input the
  client never sends), pools, layouts and seeded pages to store.
- `kvtier.testing.redis`: `RedisServer` and `RedisCluster` on loopback (Debian's `redis-server`).
- `kvtier.testing.neighbour`: `Neighbour`, another client pinging a daemon at a steady pace from a
  process of its own, for what one client's load costs the others (ping p50/p99/max).
- `kvtier.testing.policies`: an eviction policy driven through the page store's calls, for
  stories that assert the exact order in which keys leave.
- `kvtier.testing.fixtures`: the pytest fixtures built on the first two (`daemon`, `make_daemon`,
  `make_pool`, `socket_dir`, `redis_server`, `redis_cluster`); the only module importing pytest.
  Use it as a plugin: `pytest_plugins = ["kvtier.testing.fixtures"]` in a top-level conftest.py.
"""
