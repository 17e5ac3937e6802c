"""`kvtier serve`: run the daemon in the foreground."""

from __future__ import annotations

from pathlib import Path

import click

from kvtier.cli.params import BYTES
from kvtier.errors import KvtierError


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML config file (default: $KVTIER_CONFIG, else built-in defaults).")
@click.option("--socket", "socket_path", type=click.Path(path_type=Path),
              help="Control socket [default: $XDG_RUNTIME_DIR/kvtier/kvtier.sock].")
@click.option("--host-capacity", type=BYTES, help="Host tier size [default: 10% of RAM, <= 16GiB].")
@click.option("--hbm-capacity", type=BYTES,
              help="Hbm tier size: hot pages in a daemon-owned pool above host [default: 0, off].")
@click.option("--disk-path", type=click.Path(file_okay=False, path_type=Path),
              help="Disk tier directory [default: ~/.cache/kvtier/disk].")
@click.option("--disk-capacity", type=BYTES, help="Disk tier cap [default: 16GiB].")
@click.option("--no-disk", is_flag=True, default=None, help="Run with the host tier only.")
@click.option("--write-policy", type=click.Choice(["write-through", "write-back", "selective"]),
              help="When pages reach disk [default: write-back].")
@click.option("--host-policy", metavar="NAME",
              help="Host eviction policy: lru (cheapest per page, strands no page), arc, "
                   "s3fifo, or prefix (best hit ratio, ~6 us more CPU per stored page) "
                   "[default: lru].")
@click.option("--no-prefault", is_flag=True, default=None,
              help="Skip touching the arena at start (faster start, slower first copies).")
@click.option("--remote-url", metavar="URL",
              help="Redis/Valkey remote tier below disk: redis://host:6379/0, rediss://..., or "
                   "comma-separated cluster seeds [default: none].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              help="Log verbosity on stderr [default: info].")
@click.option("--log-format", type=click.Choice(["plain", "json"]),
              help="plain lines, or one JSON object per line for log shippers [default: plain].")
@click.option("--metrics-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics [default: off; "
                   "setting metrics.port, $KVTIER_METRICS_PORT].")
@click.option("--metrics-address", metavar="ADDRESS",
              help="Address of the metrics port; 0.0.0.0 or :: exposes it to the network "
                   "[default: 127.0.0.1].")
def serve(config_path: Path | None, socket_path: Path | None, host_capacity: int | None,
          hbm_capacity: int | None, disk_path: Path | None, disk_capacity: int | None,
          no_disk: bool | None, write_policy: str | None, host_policy: str | None,
          no_prefault: bool | None, remote_url: str | None, log_level: str | None,
          log_format: str | None, metrics_port: int | None,
          metrics_address: str | None) -> None:
    """Run the kvtier daemon until SIGTERM or Ctrl-C.

    Settings come from defaults, then --config (or $KVTIER_CONFIG), then KVTIER_* environment
    variables (KVTIER_HOST_CAPACITY=8GiB, KVTIER_DISK_PATH=..., one per setting), then these
    flags. Readiness: the log line "kvtier ready on <socket>", or `kvtier stats`.

    \b
    Example:
      kvtier serve --host-capacity 32GiB --disk-path /nvme/kvtier --disk-capacity 1TiB
      kvtier serve --remote-url redis://cache.internal:6379/0   # share pages between nodes
      kvtier serve --metrics-port 9464 --log-format json        # in production (docs/operations.md)
    """
    from kvtier.daemon.process import Daemon
    from kvtier.daemon.logs import configure_logging
    from kvtier.settings import SETTINGS, load_config
    from kvtier.tuning import reexec_tuned

    reexec_tuned()

    overrides = {
        "daemon.socket": socket_path, "host.capacity": host_capacity, "disk.path": disk_path,
        "disk.capacity": disk_capacity, "disk.enabled": False if no_disk else None,
        "store.write_policy": write_policy, "host.policy": host_policy,
        "host.prefault": False if no_prefault else None, "daemon.log_level": log_level,
        "remote.url": remote_url, "hbm.capacity": hbm_capacity,
        "daemon.log_format": log_format, "metrics.port": metrics_port,
        "metrics.address": metrics_address,
    }
    assert set(overrides) <= set(SETTINGS)
    try:
        config = load_config(config_path, overrides=overrides)
        configure_logging(config.log_level, config.log_format)
        Daemon(config).run()
    except KvtierError as exc:
        raise click.ClickException(str(exc)) from exc
