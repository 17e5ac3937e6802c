"""A daemon process killed in the middle of a disk write.

A child process opens a write-through `PageStore` and SIGKILLs itself at one exact point of
`DiskTier.write_pages`: (a) after the payload reached the file but before the index commit, or
(b) after the index commit but before the payload's fdatasync. A killed process keeps the page
cache, so in (a) the page must simply not exist after a restart, and in (b) it must be there,
byte-identical, though the store was never acknowledged. Either way the integrity walk is clean.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.keys import Namespace
from kvtier.shm import reclaim_orphans
from kvtier.store.page_store import PageStore

PAGE_BYTES = 16 << 10
KEY = bytes(range(16))
NAMESPACE = Namespace("crash", "uint8", "flat", 16, PAGE_BYTES)

CHILD = """
import os, signal, sys
import numpy as np
import kvtier.tiers.disk_index as index_module
from kvtier.config import DiskConfig, HostConfig, StoreConfig, WritePolicy
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[2] == "before-index":
    index_module.DiskIndex.add = die
else:  # after the index commit, before the fdatasync of the payload
    index = index_module.DiskIndex.add
    def index_then_die(self, writes):
        index(self, writes)
        die()
    index_module.DiskIndex.add = index_then_die
store = PageStore(StoreConfig(HostConfig(1 << 20, prefault=False),
                              DiskConfig(sys.argv[1], 16 << 20),
                              write_policy=WritePolicy.WRITE_THROUGH))
namespace = Namespace("crash", "uint8", "flat", 16, {page_bytes})
store.store(namespace, [bytes(range(16))], np.full((1, {page_bytes}), 7, np.uint8))
print("stored")  # never reached
"""


def crash_while_storing(disk_path: Path, moment: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(page_bytes=PAGE_BYTES),
                              str(disk_path), moment], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
        # SIGKILLed, the child could not unlink its host arena: this test does
        reclaim_orphans(("kvtier-host-",), {child.pid})
    assert child.returncode == -signal.SIGKILL, stderr
    assert "stored" not in stdout


def reopen(disk_path: Path) -> PageStore:
    return PageStore(StoreConfig(HostConfig(1 << 20, prefault=False),
                                 DiskConfig(disk_path, 16 << 20),
                                 write_policy=WritePolicy.WRITE_THROUGH))


def test_killed_before_the_index_commit_the_page_does_not_exist(tmp_path: Path) -> None:
    crash_while_storing(tmp_path / "disk", "before-index")
    with reopen(tmp_path / "disk") as store:
        assert store.lookup(NAMESPACE, [KEY]).tiers == [None]
        out = np.full((1, PAGE_BYTES), 0xEE, np.uint8)
        assert store.recall(NAMESPACE, [KEY], out).recalled == []
        assert (out == 0xEE).all()
        assert store.check(verify_bytes=True) == []


@pytest.mark.parametrize("moment", ["after-index"])
def test_killed_after_the_index_commit_the_page_is_whole(tmp_path: Path, moment: str) -> None:
    crash_while_storing(tmp_path / "disk", moment)
    with reopen(tmp_path / "disk") as store:
        assert store.check(verify_bytes=True) == []
        out = np.zeros((1, PAGE_BYTES), np.uint8)
        result = store.recall(NAMESPACE, [KEY], out)
        assert result.recalled == [KEY]
        assert (out == 7).all()
