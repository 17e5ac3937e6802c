"""The large-copy tuning: added once, never twice, only where glibc reads it."""

from __future__ import annotations

import platform

import pytest

from kvtier import tuning

glibc_x86 = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64"
    or platform.libc_ver()[0] != "glibc", reason="the tunable exists for x86-64 glibc only")


@glibc_x86
def test_threshold_is_added_to_an_environment_without_it() -> None:
    env = tuning.fast_copy_environment({"PATH": "/bin"})
    assert env is not None and env["PATH"] == "/bin"
    assert env["GLIBC_TUNABLES"] == "glibc.cpu.x86_non_temporal_threshold=0x100000"


@glibc_x86
def test_other_tunables_are_kept() -> None:
    env = tuning.fast_copy_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == ("glibc.malloc.arena_max=2:"
                                     "glibc.cpu.x86_non_temporal_threshold=0x100000")


def test_never_added_twice() -> None:
    already = {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x200000"}
    assert tuning.fast_copy_environment(already) is None
    assert tuning.fast_copy_environment({"KVTIER_TUNED": "1"}) is None
