"""Store configuration: tiers' capacities, policies and the write policy, with working defaults.

`StoreConfig()` needs no file: the host tier takes a modest share of RAM (psutil) and the disk
tier a capped directory under the user's cache dir. Each field that is a setting declares it
where it stands (`kvtier.setting_types.setting`): its dotted name, kind and help; the TOML keys,
environment variables and `kvtier serve` flags are derived from those declarations.
Verbs: `check_policy`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import psutil

from kvtier.errors import ConfigError
from kvtier.policies import POLICY_NAMES
from kvtier.setting_types import (
    BOOL,
    COUNT,
    NON_NEGATIVE_INT,
    PATH,
    SECONDS,
    SIZE,
    SIZE_OR_ZERO,
    TEXT,
    Kind,
    choice_of,
    parse_int,
    setting,
)

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


def check_policy(name: object, tier: str = "") -> str:
    """`name` if it names an eviction policy: the one check of policy names (settings, configs
    built in code, `kvtier replay`).

    Raises:
        ConfigError: no policy has that name (the message lists those that exist).
    """
    if name not in POLICY_NAMES:
        raise ConfigError(f"unknown {tier + ' ' if tier else ''}policy {name!r}; choose one of "
                          f"{', '.join(POLICY_NAMES)}")
    return str(name)


POLICY = Kind(check_policy, "|".join(POLICY_NAMES), POLICY_NAMES)
WRITE_POLICY = choice_of(WritePolicy, "write policy")


# Prefix: the best geometric mean of hits over the trace family, within 0.0002 of OPT of LRU where
# it trails it (two 25% cells, where LRU is OPT or nearly), strands no page, and costs about 3 us
# per stored page beyond LRU (bench/bench_policy_cost.py). `adaptive`, which follows it or a leaf
# order, differed from it in three cells of the family, lost two, and costs half as much again
# (docs/design-notes.md, `kvtier replay-family`).
DEFAULT_HOST_POLICY = "prefix"


@dataclass(slots=True, frozen=True)
class HostConfig:
    """The host tier: one shared-memory arena."""

    capacity_bytes: int = field(default_factory=default_host_bytes, metadata=setting(
        "host.capacity", SIZE, "host tier size, e.g. 8GiB", "3GiB",
        default_text="10% of RAM, at most 16GiB"))
    chunk_bytes: int = field(default=DEFAULT_CHUNK_BYTES, metadata=setting(
        "host.chunk", SIZE, "host slot chunk (largest page size)", "128MiB"))
    policy: str = field(default=DEFAULT_HOST_POLICY, metadata=setting(
        "host.policy", POLICY, "host eviction policy: prefix (best hit ratio over the trace "
        "family, a few us more CPU per stored page), lru (cheapest, strands no page), adaptive "
        "(follows prefix or a leaf order, more CPU), leader, arc or s3fifo", "lru"))
    prefault: bool = field(default=True, metadata=setting(
        "host.prefault", BOOL, "touch the arena at start (--no-prefault: faster start, slower "
        "first copies)", "false", flag="prefault"))

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError(f"host capacity must be positive, got {self.capacity_bytes} bytes")
        check_policy(self.policy, "host")


DEFAULT_HBM_CHUNK_BYTES = 64 << 20


def _parse_hbm_device(text: object) -> int | None:
    if text is None or str(text).strip().lower() in ("", "host", "none"):
        return None
    value = parse_int(text)
    if value < 0:
        raise ConfigError(f"must be a GPU number or host, got {text!r}")
    return value


HBM_DEVICE = Kind(_parse_hbm_device, "GPU|host")


@dataclass(slots=True, frozen=True)
class HbmConfig:
    """The hbm tier: a daemon-owned device page pool above host; off while `capacity_bytes` is 0.

    Pages are promoted into it on their `promote_hits`-th hit. `device` is the GPU holding it;
    None keeps it in host memory (the stand-in used without a GPU, and by tests).
    """

    capacity_bytes: int = field(default=0, metadata=setting(
        "hbm.capacity", SIZE_OR_ZERO, "hbm tier size: hot pages in a daemon-owned device pool "
        "above host; 0: off", "1GiB"))
    chunk_bytes: int = field(default=DEFAULT_HBM_CHUNK_BYTES, metadata=setting(
        "hbm.chunk", SIZE, "hbm slot chunk (largest page size)", "32MiB"))
    policy: str = field(default="lru", metadata=setting(
        "hbm.policy", POLICY, "hbm eviction policy", "arc"))
    promote_hits: int = field(default=2, metadata=setting(
        "hbm.promote_hits", COUNT, "hits after which a host page is promoted to hbm", "3"))
    device: int | None = field(default=None, metadata=setting(
        "hbm.device", HBM_DEVICE, "GPU holding the hbm tier, or host for a host-memory stand-in",
        "0", default_text="host"))

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
        check_policy(self.policy, "hbm")


@dataclass(slots=True, frozen=True)
class DiskConfig:
    """The disk tier: a slot file and an LMDB index in one directory; disabled when `enabled` is
    False."""

    path: Path = field(default_factory=default_disk_path, metadata=setting(
        "disk.path", PATH, "disk tier directory", "/nvme/kvtier",
        default_text="$XDG_CACHE_HOME/kvtier/disk, else ~/.cache/kvtier/disk"))
    capacity_bytes: int = field(default=DEFAULT_DISK_BYTES, metadata=setting(
        "disk.capacity", SIZE, "disk tier cap, e.g. 64GiB", "100GiB"))
    chunk_bytes: int = field(default=DEFAULT_CHUNK_BYTES, metadata=setting(
        "disk.chunk", SIZE, "disk slot file chunk", "64MiB"))
    policy: str = field(default="lru", metadata=setting(
        "disk.policy", POLICY, "disk eviction policy", "s3fifo"))
    enabled: bool = field(default=True, metadata=setting(
        "disk.enabled", BOOL, "use a disk tier (--no-disk: the host tier only)", "false",
        flag="disk"))

    def __post_init__(self) -> None:
        if self.enabled and self.capacity_bytes <= 0:
            raise ConfigError(f"disk capacity must be positive, got {self.capacity_bytes} bytes")
        check_policy(self.policy, "disk")


REMOTE_WRITE_MODES = ("through", "evict")


def _check_remote_url(text: object) -> str:
    """`text`, stripped, if each of its comma-separated URLs has a scheme the tier speaks."""
    url = str(text).strip()
    for one_url in filter(None, (u.strip() for u in url.split(","))):
        if not one_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"remote url {one_url!r} must start with redis://, rediss:// or "
                              f"unix://")
    return url


def _check_remote_write(text: object) -> str:
    if text not in REMOTE_WRITE_MODES:
        raise ConfigError(f"unknown remote write mode {text!r}; choose "
                          f"{' or '.join(REMOTE_WRITE_MODES)}")
    return str(text)


REMOTE_URL = Kind(_check_remote_url, "URL")
REMOTE_WRITE = Kind(_check_remote_write, "|".join(REMOTE_WRITE_MODES), REMOTE_WRITE_MODES)


@dataclass(slots=True, frozen=True)
class RemoteConfig:
    """The remote tier (Redis / Valkey) below disk; disabled while `url` is empty.

    `url`: `redis://host:port/db` or `rediss://...`; several comma-separated URLs (or `cluster`)
    name the seed nodes of a cluster. `write`: "through" sends every stored page (other nodes can
    reuse it at once), "evict" sends a page when its last local copy is evicted.
    """

    url: str = field(default="", metadata=setting(
        "remote.url", REMOTE_URL, "Redis/Valkey URL of a tier below disk (redis://host:6379/0, "
        "rediss://...); several comma-separated for a cluster's seeds", "redis://cache:6379/0",
        default_text="none"))
    cluster: bool = field(default=False, metadata=setting(
        "remote.cluster", BOOL, "treat a single URL as a cluster seed", "true"))
    write: str = field(default="through", metadata=setting(
        "remote.write", REMOTE_WRITE, "through (send every stored page) or evict (send a page "
        "when its last local copy is evicted)", "evict"))
    timeout_s: float = field(default=0.5, metadata=setting(
        "remote.timeout", SECONDS, "seconds a remote round trip may take before it counts as a "
        "miss and the tier goes offline", "0.25"))
    ttl_s: int = field(default=0, metadata=setting(
        "remote.ttl", NON_NEGATIVE_INT, "seconds remote pages live on the server; 0: no expiry",
        "86400"))
    budget_bytes: int = field(default=0, metadata=setting(
        "remote.budget", SIZE_OR_ZERO, "bytes this node may have written to the remote at once "
        "(oldest deleted first); 0: no cap", "64GiB"))
    key_prefix: str = field(default="kvtier", metadata=setting(
        "remote.key_prefix", TEXT, "prefix of every remote key", "node-a"))
    max_pending_bytes: int = 256 << 20  # queued, not yet sent; beyond it writes are dropped

    @property
    def enabled(self) -> bool:
        """Whether a remote tier is configured."""
        return bool(self.url.strip())

    def __post_init__(self) -> None:
        _check_remote_write(self.write)
        if self.timeout_s <= 0:
            raise ConfigError(f"remote timeout must be positive, got {self.timeout_s} s")
        if self.ttl_s < 0 or self.budget_bytes < 0:
            raise ConfigError("remote ttl and budget must not be negative")
        _check_remote_url(self.url)


@dataclass(slots=True, frozen=True)
class StoreConfig:
    """Everything a `PageStore` needs to start."""

    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    write_policy: WritePolicy = field(default=WritePolicy.WRITE_BACK, metadata=setting(
        "store.write_policy", WRITE_POLICY, "when pages reach disk: at store (write-through), "
        "when evicted from host (write-back), or when evicted after selective_min_hits hits",
        "write-through"))
    selective_min_hits: int = field(default=2, metadata=setting(
        "store.selective_min_hits", COUNT, "hits before a page is demoted under selective", "4"))
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)
    with_bytes: bool = True  # False: metadata only (trace replay): no arena, no files, no copies
    # False: each tier keeps the chunk asked for, however few chunks that makes (trace replay:
    # one page size, and a capacity in pages that must be exact); see `fit_chunk_bytes`.
    fit_chunks: bool = True
    # Namespaces are persisted in the disk index and loaded at every start: bounded, so a client
    # registering many (or long-named) ones cannot fill the index or the daemon's memory.
    max_namespaces: int = field(default=1024, metadata=setting(
        "store.max_namespaces", COUNT, "namespaces known at once; when full, those without pages "
        "are forgotten, then registrations refused", "4096"))
    max_model_id_bytes: int = field(default=512, metadata=setting(
        "store.max_model_id_bytes", COUNT, "longest namespace model id (and layout name)", "256"))

    def __post_init__(self) -> None:
        if self.max_namespaces < 1 or self.max_model_id_bytes < 1:
            raise ConfigError("max_namespaces and max_model_id_bytes must be at least 1")
        if self.selective_min_hits < 1:
            raise ConfigError(f"selective_min_hits must be at least 1, "
                              f"got {self.selective_min_hits}")
