"""Who serves the daemon's socket: the client's check before it says hello.

A server of another uid than ours or root's could be another local user's fake, to whom
registering a pool would hand our pages. Trust a daemon run by another uid with
`trusted_server_uids` or `$KVTIER_TRUSTED_SERVER_UIDS` (comma-separated). Verbs: `check_server`.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence

from kvtier.errors import KvtierError, UntrustedServerError

TRUSTED_SERVER_UIDS_ENV = "KVTIER_TRUSTED_SERVER_UIDS"
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def _trusted_uids(trusted_server_uids: Sequence[int]) -> set[int]:
    from_env = os.environ.get(TRUSTED_SERVER_UIDS_ENV, "")
    try:
        env_uids = {int(part) for part in from_env.split(",") if part.strip()}
    except ValueError:
        raise KvtierError(f"${TRUSTED_SERVER_UIDS_ENV} must list uids separated by commas, "
                          f"got {from_env!r}") from None
    # root can read any process's memory anyway: trusting it exposes nothing more.
    return {os.getuid(), 0, *trusted_server_uids, *env_uids}


def check_server(sock: socket.socket, path: str,
                 trusted_server_uids: Sequence[int] = ()) -> tuple[int, int]:
    """Refuse a server that runs as a uid we do not trust; return its (pid, uid).

    Raises:
        UntrustedServerError: the peer's uid is not ours, root's, nor one we were told to trust.
    """
    pid, uid, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    if uid not in _trusted_uids(trusted_server_uids):
        raise UntrustedServerError(
            f"the process serving {path} (pid {pid}) runs as uid {uid}, not as us (uid "
            f"{os.getuid()}): it may be another user's fake daemon; if a daemon of that uid is "
            f"yours to use, pass trusted_server_uids=[{uid}] or set "
            f"{TRUSTED_SERVER_UIDS_ENV}={uid}")
    return pid, uid
