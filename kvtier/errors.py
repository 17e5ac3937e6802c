"""One error hierarchy for kvtier.

Every error a caller can act on derives from `KvtierError`; each carries a short stable `code`
that the daemon puts in error replies, and a sentence a user can act on.

A corrupt page is not an error here: the tiers verify every page they read (`verify_page`) and
the store treats a page that fails as missing (dropped, never served, named in the recall's
reply), so no caller ever has an integrity failure to catch.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every kvtier error."""

    code = "error"


class ConfigError(KvtierError):
    """A configuration value is missing, malformed or out of range."""

    code = "bad_config"


class ProtocolError(KvtierError):
    """A request is malformed: wrong types, bad key length, unknown namespace."""

    code = "bad_request"


class CapacityError(KvtierError):
    """A tier has no room left for a page, even after eviction."""

    code = "no_capacity"


class StorageError(KvtierError):
    """The disk tier could not write or read: full file system, I/O error."""

    code = "storage"


class TransferError(KvtierError):
    """A copy failed; `failed_keys` names exactly the pages that were not moved."""

    code = "transfer"

    def __init__(self, message: str, failed_keys: list[bytes] | None = None) -> None:
        super().__init__(message)
        self.failed_keys = list(failed_keys or [])


class QuotaError(KvtierError):
    """A client asked for more than its share: connections, pools, leases, buffered frame bytes."""

    code = "quota"


class FrameTooLarge(ProtocolError):
    """A frame's length prefix exceeds the cap; the connection must close."""

    code = "frame_too_large"


class DaemonError(KvtierError):
    """The daemon cannot start (socket in use, bad directory)."""

    code = "daemon"


class LaunchError(KvtierError):
    """A daemon started as a child process did not become ready, or did not stop in time."""

    code = "launch"


class TraceError(ConfigError):
    """A trace file that cannot be read; the message names the line."""


class BackendUnavailableError(KvtierError):
    """A copy backend this request needs is not installed here (CuPy, for GPU pools)."""

    code = "backend_unavailable"


class UntrustedServerError(KvtierError, ConnectionError):
    """The process serving the daemon's socket runs as a uid the client was not told to trust."""

    code = "untrusted_server"


class IndexRefusedError(KvtierError):
    """The daemon's lookup index is not one the client may trust or map (lookups then go over
    the socket); the daemon refuses to publish one with code `unavailable` (a remote tier)."""

    code = "index_refused"


class DaemonReplyError(KvtierError):
    """The daemon answered a client's request with an error; `code` is its error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
