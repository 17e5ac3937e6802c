"""Fixtures for tests against a real daemon process; the machinery is in daemon_harness.py.

Tests are imported with importlib (no package), so the harness is loaded by path once, under
the module name `kvtier_daemon_harness`, which test modules then take from `sys.modules`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HARNESS_MODULE = "kvtier_daemon_harness"


def load_harness() -> ModuleType:
    """The harness module, loaded from tests/daemon/daemon_harness.py on first use."""
    if HARNESS_MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            HARNESS_MODULE, Path(__file__).with_name("daemon_harness.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[HARNESS_MODULE] = module
        spec.loader.exec_module(module)
    return sys.modules[HARNESS_MODULE]


_harness = load_harness()
daemon = _harness.daemon
make_daemon = _harness.make_daemon
make_pool = _harness.make_pool
socket_dir = _harness.socket_dir
