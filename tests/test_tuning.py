"""The process tuning: added once, never twice, only where glibc reads it, other tunables kept."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from kvtier import tuning

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc tunables")
glibc_x86 = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64"
    or platform.libc_ver()[0] != "glibc", reason="the copy tunable exists for x86-64 glibc only")

ALL = ("glibc.malloc.mmap_threshold=0x400000:glibc.malloc.trim_threshold=0x4000000:"
       "glibc.malloc.arena_max=0x1:glibc.cpu.x86_non_temporal_threshold=0x100000")


@glibc_x86
def test_tunables_are_added_to_an_environment_without_them() -> None:
    env = tuning.tuned_environment({"PATH": "/bin"})
    assert env is not None and env["PATH"] == "/bin"
    assert env["GLIBC_TUNABLES"] == ALL and env["KVTIER_TUNED"] == "1"


@glibc_x86
def test_other_tunables_are_kept() -> None:
    env = tuning.tuned_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=7:" + ALL


@glibc_x86
def test_a_tunable_the_user_set_is_left_alone() -> None:
    env = tuning.tuned_environment({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0x1000"})
    tunables = env["GLIBC_TUNABLES"]
    assert tunables.count("trim_threshold") == 1 and "trim_threshold=0x1000" in tunables


def test_never_added_twice() -> None:
    assert tuning.tuned_environment({"GLIBC_TUNABLES": ALL}) is None
    assert tuning.tuned_environment({"KVTIER_TUNED": "1"}) is None


@glibc
def test_the_tuned_process_really_runs_with_the_tunables() -> None:
    env = tuning.tuned_environment({})
    assert env is not None
    shown = subprocess.run([sys.executable, "-c", "import os; print(os.environ['GLIBC_TUNABLES'])"],
                           env=env, capture_output=True, text=True, timeout=60, check=True)
    assert "glibc.malloc.mmap_threshold=0x400000" in shown.stdout
