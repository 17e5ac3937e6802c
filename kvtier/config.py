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


@dataclass(slots=True, frozen=True)
class HostConfig:
    """The host tier: one shared-memory arena."""

    capacity_bytes: int = field(default_factory=default_host_bytes)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    policy: str = "lru"
    prefault: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError(f"host capacity must be positive, got {self.capacity_bytes} bytes")
        _check_policy(self.policy, "host")


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


@dataclass(slots=True, frozen=True)
class StoreConfig:
    """Everything a `PageStore` needs to start."""

    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    selective_min_hits: int = 2
    with_bytes: bool = True  # False: metadata only (trace replay): no arena, no files, no copies

    def __post_init__(self) -> None:
        if self.selective_min_hits < 1:
            raise ConfigError(f"selective_min_hits must be at least 1, got {self.selective_min_hits}")
