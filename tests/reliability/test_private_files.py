"""Everything a real daemon creates is private to its uid: 0700 directories, 0600 files (#19, 8).

The disk index names models and keys, and keys are deterministic: another user who can read it
learns which prompts are cached. The daemon is started with umask 000 so that no mode here comes
from the test's umask.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.testing import daemon as harness


@pytest.fixture
def open_umask() -> Iterator[None]:
    """Start daemons with umask 000 (children inherit it)."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _modes_open_to_others(paths: list[Path]) -> dict[str, str]:
    return {str(path): oct(stat.S_IMODE(path.lstat().st_mode)) for path in paths
            if path.lstat().st_mode & 0o077}


def _store_write_through(daemon, make_pool) -> str:  # noqa: ANN001
    layout = harness.make_layout("page-first", 4)
    pool = make_pool(layout)
    harness.fill_random(pool, np.random.default_rng(), range(4))
    with daemon.client() as client:
        handle = pool.register(client, harness.namespace_for(layout, "private-model"))
        assert client.store(handle, harness.random_keys(np.random.default_rng(), 4),
                            range(4)).result().ok
        return client.arena_segment


def test_every_file_and_directory_the_daemon_creates_is_private(
        open_umask, make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    socket_path = socket_dir / "run" / "k.sock"
    disk = tmp_path / "cache" / "kvtier" / "disk"
    daemon = make_daemon(socket_path, disk, "--write-policy", "write-through")
    arena = _store_write_through(daemon, make_pool)

    created = [socket_path.parent, socket_path, daemon.lock_path, Path("/dev/shm", arena),
               tmp_path / "cache", tmp_path / "cache" / "kvtier", disk, *disk.rglob("*")]
    names = {path.name for path in created}
    assert {"index", "data.mdb", "lock.mdb", "pages.slots", "disk.lock"} <= names
    assert _modes_open_to_others(created) == {}
    daemon.stop_and_check()


def test_an_index_an_older_kvtier_left_readable_is_made_private(
        open_umask, make_daemon, socket_dir: Path, tmp_path: Path, make_pool) -> None:
    disk = tmp_path / "disk"
    daemon = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    _store_write_through(daemon, make_pool)
    daemon.stop_and_check()
    os.chmod(disk / "index", 0o755)
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(disk / "index" / name, 0o644)

    restarted = make_daemon(socket_dir / "k.sock", disk, "--write-policy", "write-through")
    assert _modes_open_to_others([disk / "index", *(disk / "index").iterdir()]) == {}
    restarted.stop_and_check()
