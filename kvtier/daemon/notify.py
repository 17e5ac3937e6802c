"""Readiness for systemd (`Type=notify`): the sd_notify protocol, without libsystemd.

systemd passes the path of a datagram socket in `$NOTIFY_SOCKET` (a leading `@` names Linux's
abstract namespace); a service reports state by sending it newline-separated `KEY=value`
assignments. The daemon sends `READY=1` once it serves its socket, and `STOPPING=1` when it
begins to shut down; without `$NOTIFY_SOCKET` (not under systemd) nothing is sent. Verbs:
`notify`, `notify_ready`, `notify_stopping`.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def notify(state: str, env: dict[str, str] | None = None) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving") to systemd's notify socket.

    Returns:
        True when it was sent; False when there is no `$NOTIFY_SOCKET` or the send failed (a
        failure is logged: systemd then times the start out, which is its own clear error).
    """
    path = (os.environ if env is None else env).get(NOTIFY_SOCKET_ENV, "")
    if not path:
        return False
    if path[0] == "@":
        address: str | bytes = b"\0" + path[1:].encode()  # abstract namespace
    elif path[0] == "/":
        address = path
    else:
        log.warning("ignoring %s=%r: neither a path nor an abstract socket name",
                    NOTIFY_SOCKET_ENV, path)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("could not notify systemd through %s: %s", path, exc)
        return False
    return True


def notify_ready(status: str) -> bool:
    """Tell systemd the daemon is ready, with a one-line `status` for `systemctl status`."""
    return notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")


def notify_stopping() -> bool:
    """Tell systemd the daemon is shutting down."""
    return notify("STOPPING=1\nSTATUS=shutting down")
