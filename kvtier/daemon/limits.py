"""Limits: what one client, and all clients together, may hold in the daemon.

One daemon serves every engine of a node, so no client, buggy or greedy, may take more than its
share of what is finite: file descriptors (a connection or a shared-memory pool holds one),
memory for half-received frames, the event loop's time, and leases. `Limits` holds the caps (the
`daemon.*` settings); `FdBudget` counts the descriptors connections and pools hold against the
process's RLIMIT_NOFILE, raised to its hard limit at start (`raise_fd_limit`). Going past a cap
is a `QuotaError` reply to that client, never the daemon's own failure.
"""

from __future__ import annotations

import logging
import resource
import threading
from dataclasses import dataclass, field

from kvtier.errors import ConfigError, QuotaError
from kvtier.setting_types import COUNT, SECONDS, SIZE, Kind, setting

log = logging.getLogger(__name__)

# Descriptors kept for everything that is not a connection or a pool: the disk tier's files, the
# LMDB index, the remote tier's sockets, /dev/shm scans, CUDA's device files, logging.
FD_RESERVE = 256


def _parse_share(text: object) -> float:
    """A share of a whole: 0.25 or 25%, above 0 and at most 1."""
    written = str(text).strip()
    try:
        value = float(written[:-1]) / 100 if written.endswith("%") else float(written)
    except ValueError:
        raise ConfigError(f"must be a share such as 0.25 or 25%, got {text!r}") from None
    if not 0 < value <= 1:
        raise ConfigError(f"must be a share above 0 and at most 1 (100%), got {text!r}")
    return value


SHARE = Kind(_parse_share, "SHARE")  # 0.25 or 25%


@dataclass(slots=True, frozen=True)
class Limits:
    """Caps on what clients may hold (the `daemon.*` settings of the same names)."""

    max_clients: int = field(default=256, metadata=setting(
        "daemon.max_clients", COUNT, "connections at once; beyond, a clear refusal", "16"))
    max_clients_per_peer: int = field(default=64, metadata=setting(
        "daemon.max_clients_per_peer", COUNT, "connections one process (uid and pid from "
        "SO_PEERCRED) may hold at once, so that no process takes every client slot", "8"))
    max_pools_per_client: int = field(default=128, metadata=setting(
        "daemon.max_pools_per_client", COUNT, "pools one connection may register", "8"))
    max_leases_per_client: int = field(default=1024, metadata=setting(
        "daemon.max_leases_per_client", COUNT, "live leases one connection may hold", "64"))
    # A share of each tier, not a page count: what one client may hold back from eviction must
    # leave the others room whatever the tier sizes and page sizes.
    max_pinned_share: float = field(default=0.25, metadata=setting(
        "daemon.max_pinned_share", SHARE, "share of each tier's bytes the pages one connection "
        "pins may hold; a lease beyond it is refused", "10%"))
    max_lease_s: float = field(default=3600.0, metadata=setting(
        "daemon.max_lease", SECONDS, "longest lease ttl a client may ask, in seconds; longer is "
        "refused", "600"))
    max_buffered_bytes: int = field(default=256 << 20, metadata=setting(
        "daemon.max_buffered_bytes", SIZE, "half-received frame bytes, all clients together; "
        "beyond, the sender is cut off", "64MiB"))
    frame_timeout_s: float = field(default=30.0, metadata=setting(
        "daemon.frame_timeout", SECONDS, "seconds a frame may take from first to last byte",
        "5"))
    frames_per_turn: int = field(default=64, metadata=setting(
        "daemon.frames_per_turn", COUNT, "frames one client gets answered before others get a "
        "turn of the event loop", "16"))
    bytes_per_turn: int = field(default=64 << 10, metadata=setting(
        "daemon.bytes_per_turn", SIZE, "frame bytes (about 18 per key) one client gets answered "
        "on the event loop before others get a turn: the loop's work is bounded by keys, not "
        "frames", "16KiB"))
    inline_frame_bytes: int = field(default=16 << 10, metadata=setting(
        "daemon.inline_frame_bytes", SIZE, "largest frame decoded and answered on the event "
        "loop (a lookup or pin of ~900 keys); larger ones are decoded on a thread of their own "
        "and answered off the loop", "4KiB"))

    def __post_init__(self) -> None:
        for name in ("max_clients", "max_clients_per_peer", "max_pools_per_client",
                     "max_leases_per_client", "max_buffered_bytes", "frames_per_turn",
                     "bytes_per_turn", "inline_frame_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"daemon.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_lease_s", "frame_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ConfigError(f"daemon.{name.removesuffix('_s')} must be a positive number "
                                  f"of seconds, got {value}")


DEFAULT_LIMITS = Limits()  # frozen: one instance serves every default


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the new soft limit.

    The usual soft limit (1024) is a default for interactive shells; a daemon holding one
    descriptor per client and per pool needs what the administrator allows (the hard limit,
    `LimitNOFILE=` under systemd).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. an infinite hard limit above the kernel's cap
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


class FdBudget:
    """Descriptors that connections and pools may hold, below the process's open-file limit.

    Thread-safe: connections take theirs on the event loop, pools on copy threads.
    """

    def __init__(self, fd_limit: int, reserve: int = FD_RESERVE) -> None:
        self.capacity = max(fd_limit - reserve, 0)
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Descriptors held by connections and pools now."""
        return self._used

    def try_take(self, num_fds: int = 1) -> bool:
        """Take `num_fds` if they fit; False (and nothing taken) if they do not."""
        with self._lock:
            if self._used + num_fds > self.capacity:
                return False
            self._used += num_fds
            return True

    def take(self, num_fds: int, what: str) -> None:
        """Take `num_fds` for `what`.

        Raises:
            QuotaError: the daemon's open-file limit would be reached.
        """
        if not self.try_take(num_fds):
            raise QuotaError(f"the daemon holds {self._used} descriptors, all its open-file "
                             f"limit allows ({self.capacity} after a reserve of {FD_RESERVE}); "
                             f"no {what} until some are released (or raise its LimitNOFILE)")

    def give_back(self, num_fds: int = 1) -> None:
        """Return descriptors taken before."""
        with self._lock:
            self._used = max(self._used - num_fds, 0)
