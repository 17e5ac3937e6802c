"""A tier that takes less than its capacity setting asked for says so at start, and why: whole
chunks, and "100MB" meaning 10^8 bytes (decimal), not 100 MiB."""

from __future__ import annotations

from pathlib import Path


def test_a_decimal_capacity_rounded_to_chunks_is_said(make_daemon, socket_dir: Path,
                                                      tmp_path: Path) -> None:
    # 1 MiB chunks leave the tier over 16 of them, so start keeps them as asked (it lowers the
    # chunks of a tier that would hold fewer, and then rounds to those)
    daemon = make_daemon(socket_dir / "c.sock", tmp_path / "disk", "--host-chunk", "1MiB",
                         host_capacity="100MB")
    daemon.assert_logged("host tier: host.capacity asked for 100000000 bytes (95.4 MiB), took "
                         "95.0 MiB: a tier is whole 1.0 MiB chunks (host.chunk); KB, MB, GB, TB "
                         "are decimal")
    # 256MiB in 16 chunks of 16 MiB: taken as asked (its lowered chunks have their own line)
    assert "disk tier: disk.capacity asked for" not in daemon.log()


def test_a_capacity_rounded_to_lowered_chunks_names_the_chunks_taken(make_daemon, socket_dir: Path,
                                                                    tmp_path: Path) -> None:
    # 100MB holds 5 chunks of 16 MiB: start lowers them to 16 chunks of 6.0 MiB, and rounds to those
    daemon = make_daemon(socket_dir / "c.sock", tmp_path / "disk", "--host-chunk", "16MiB",
                         host_capacity="100MB")
    daemon.assert_logged("host tier: host.capacity asked for 100000000 bytes (95.4 MiB), took "
                         "95.4 MiB: a tier is whole 6.0 MiB chunks (host.chunk)")
