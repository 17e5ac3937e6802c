"""Where the control socket is when nobody says: the one address both sides agree on unasked.

The daemon listens there and a client connects there when neither is given a path, so the
default lives on the wire's side, beside the frames: a client reads it without loading the
daemon. Verb: `default_socket_path`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def default_socket_path() -> Path:
    """`$XDG_RUNTIME_DIR/kvtier/kvtier.sock`, else a per-user directory under the temp dir."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    base = (Path(runtime_dir) if runtime_dir
            else Path(tempfile.gettempdir()) / f"kvtier-{os.getuid()}")
    return base / "kvtier" / "kvtier.sock" if runtime_dir else base / "kvtier.sock"
