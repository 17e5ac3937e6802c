"""A tier that takes less than its capacity setting asked for says so at start, and why: whole
chunks, and "100MB" meaning 10^8 bytes (decimal), not 100 MiB."""

from __future__ import annotations

from pathlib import Path


def test_a_decimal_capacity_rounded_to_chunks_is_said(make_daemon, socket_dir: Path,
                                                      tmp_path: Path) -> None:
    daemon = make_daemon(socket_dir / "c.sock", tmp_path / "disk", "--host-chunk", "16MiB",
                         host_capacity="100MB")
    daemon.assert_logged("host tier: host.capacity asked for 100000000 bytes (95.4 MiB), took "
                         "80.0 MiB: a tier is whole 16.0 MiB chunks (host.chunk); KB, MB, GB, TB "
                         "are decimal")
    assert "disk tier:" not in daemon.log()  # 256MiB in 256 MiB chunks: taken as asked
