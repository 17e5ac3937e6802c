"""Store configuration: tiers' capacities, policies and the write policy, with working defaults.

`StoreConfig.default()` needs no file: the host tier takes a modest share of RAM (psutil) and the
disk tier a capped directory under the user's cache dir.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import psutil

from kvtier.errors import ConfigError
from kvtier.policies import POLICY_NAMES

DEFAULT_HOST_SHARE = 0.10  # of total RAM
DEFAULT_HOST_MAX_BYTES = 16 << 30
DEFAULT_DISK_BYTES = 16 << 30
DEFAULT_CHUNK_BYTES = 256 << 20


class WritePolicy(Enum):
    """When a page reaches the disk tier."""

    WRITE_THROUGH = "write-through"  # at store: acknowledged means durable
    WRITE_BACK = "write-back"  # when evicted from host
    SELECTIVE = "selective"  # when evicted from host after at least `selective_min_hits` hits


def default_disk_path() -> Path:
    """`$XDG_CACHE_HOME/kvtier/disk`, or `~/.cache/kvtier/disk`."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "kvtier" / "disk"


def default_host_bytes() -> int:
    """A modest share of this machine's RAM: 10%, at most 16 GiB."""
    return min(int(psutil.virtual_memory().total * DEFAULT_HOST_SHARE), DEFAULT_HOST_MAX_BYTES)


def _check_policy(name: str, tier: str) -> None:
    if name not in POLICY_NAMES:
        raise ConfigError(f"unknown {tier} policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


# Adaptive: with `prefix` the best geometric mean of hits over the trace family, never below LRU,
# and it leaves the density order where another wins (docs/design-notes.md, `kvtier
# replay-family`); it strands no page, and costs some microseconds per stored page more than
# `lru` (bench/bench_policy_cost.py).
DEFAULT_HOST_POLICY = "adaptive"


@dataclass(slots=True, frozen=True)
class HostConfig:
    """The host tier: one shared-memory arena."""

    capacity_bytes: int = field(default_factory=default_host_bytes)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    policy: str = DEFAULT_HOST_POLICY
    prefault: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError(f"host capacity must be positive, got {self.capacity_bytes} bytes")
        _check_policy(self.policy, "host")


DEFAULT_HBM_CHUNK_BYTES = 64 << 20


@dataclass(slots=True, frozen=True)
class HbmConfig:
    """The hbm tier: a daemon-owned device page pool above host; off while `capacity_bytes` is 0.

    Pages are promoted into it on their `promote_hits`-th hit. `device` is the GPU holding it;
    None keeps it in host memory (the stand-in used without a GPU, and by tests).
    """

    capacity_bytes: int = 0
    chunk_bytes: int = DEFAULT_HBM_CHUNK_BYTES
    policy: str = "lru"
    promote_hits: int = 2
    device: int | None = None

    @property
    def enabled(self) -> bool:
        """Whether the tier is on."""
        return self.capacity_bytes > 0

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ConfigError(f"hbm capacity must not be negative, got {self.capacity_bytes} "
                              f"bytes (0 turns the tier off)")
        if self.promote_hits < 1:
            raise ConfigError(f"hbm promote_hits must be at least 1, got {self.promote_hits}")
        if self.device is not None and self.device < 0:
            raise ConfigError(f"hbm device must be a GPU number, got {self.device}")
        _check_policy(self.policy, "hbm")


@dataclass(slots=True, frozen=True)
class DiskConfig:
    """The disk tier: a slot file and an LMDB index in one directory; disabled when `enabled` is False."""

    path: Path = field(default_factory=default_disk_path)
    capacity_bytes: int = DEFAULT_DISK_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    policy: str = "lru"
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.enabled and self.capacity_bytes <= 0:
            raise ConfigError(f"disk capacity must be positive, got {self.capacity_bytes} bytes")
        _check_policy(self.policy, "disk")


REMOTE_WRITE_MODES = ("through", "evict")


@dataclass(slots=True, frozen=True)
class RemoteConfig:
    """The remote tier (Redis / Valkey) below disk; disabled while `url` is empty.

    `url`: `redis://host:port/db` or `rediss://...`; several comma-separated URLs (or `cluster`)
    name the seed nodes of a cluster. `write`: "through" sends every stored page (other nodes can
    reuse it at once), "evict" sends a page when its last local copy is evicted.
    """

    url: str = ""
    cluster: bool = False
    write: str = "through"
    timeout_s: float = 0.5
    ttl_s: int = 0  # 0: pages never expire on the server
    budget_bytes: int = 0  # what this node may have written at once; 0: no cap
    key_prefix: str = "kvtier"
    max_pending_bytes: int = 256 << 20  # queued, not yet sent; beyond it writes are dropped

    @property
    def enabled(self) -> bool:
        """Whether a remote tier is configured."""
        return bool(self.url.strip())

    def __post_init__(self) -> None:
        if self.write not in REMOTE_WRITE_MODES:
            raise ConfigError(f"unknown remote write mode {self.write!r}; choose "
                              f"{' or '.join(REMOTE_WRITE_MODES)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"remote timeout must be positive, got {self.timeout_s} s")
        if self.ttl_s < 0 or self.budget_bytes < 0:
            raise ConfigError("remote ttl and budget must not be negative")
        for url in filter(None, (u.strip() for u in self.url.split(","))):
            if not url.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError(f"remote url {url!r} must start with redis://, rediss:// or "
                                  f"unix://")


@dataclass(slots=True, frozen=True)
class StoreConfig:
    """Everything a `PageStore` needs to start."""

    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    selective_min_hits: int = 2
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)
    with_bytes: bool = True  # False: metadata only (trace replay): no arena, no files, no copies
    # Namespaces are persisted in the disk index and loaded at every start: bounded, so a client
    # registering many (or long-named) ones cannot fill the index or the daemon's memory.
    max_namespaces: int = 1024
    max_model_id_bytes: int = 512

    def __post_init__(self) -> None:
        if self.max_namespaces < 1 or self.max_model_id_bytes < 1:
            raise ConfigError("max_namespaces and max_model_id_bytes must be at least 1")
        if self.selective_min_hits < 1:
            raise ConfigError(f"selective_min_hits must be at least 1, got {self.selective_min_hits}")
