"""Daemon settings: defaults < TOML file < KVTIER_* environment < command-line overrides.

Every bad value must name its setting and where it came from; an unknown name lists the known
ones. `env` is always passed explicitly, so the tests never see this machine's environment.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import WritePolicy
from kvtier.daemon.settings import SETTINGS, DaemonConfig, load_config
from kvtier.errors import ConfigError
from kvtier.ipc.frames import DEFAULT_MAX_FRAME_BYTES
from kvtier.ipc.socket_path import default_socket_path

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture
def config_file(tmp_path: Path):
    """`config_file(text)`: a TOML file holding `text`."""

    def write(text: str) -> Path:
        path = tmp_path / "kvtier.toml"
        path.write_text(text)
        return path

    return write


def test_defaults_need_no_file_and_no_environment() -> None:
    config = load_config(env={})

    assert config.max_frame_bytes == DEFAULT_MAX_FRAME_BYTES
    assert config.allowed_uids == ()
    assert config.copy_threads == DaemonConfig().copy_threads
    assert config.store.write_policy is WritePolicy.WRITE_BACK
    assert config.store.host.capacity_bytes > 0 and config.store.disk.enabled


def test_default_socket_lives_in_the_runtime_dir(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))

    assert default_socket_path() == tmp_path / "kvtier" / "kvtier.sock"
    assert load_config(env={}).socket_path == tmp_path / "kvtier" / "kvtier.sock"


def test_each_layer_overrides_the_one_before(config_file) -> None:
    path = config_file("[host]\ncapacity = '2GiB'\npolicy = 'arc'\n"
                       "[disk]\ncapacity = '100GiB'\n[daemon]\ncopy_threads = 3\n")
    env = {"KVTIER_HOST_CAPACITY": "3GiB", "KVTIER_DAEMON_COPY_THREADS": "5"}
    overrides = {"host.capacity": 4 * GiB, "daemon.copy_threads": None}  # None: flag not given

    assert load_config(path, env={}).store.host.capacity_bytes == 2 * GiB
    assert load_config(path, env=env).store.host.capacity_bytes == 3 * GiB
    config = load_config(path, env=env, overrides=overrides)

    assert config.store.host.capacity_bytes == 4 * GiB  # command line wins
    assert config.copy_threads == 5  # environment over file; an unset flag changes nothing
    assert config.store.host.policy == "arc"  # only in the file
    assert config.store.disk.capacity_bytes == 100 * GiB


def test_kvtier_config_environment_variable_picks_the_file(config_file, tmp_path: Path) -> None:
    path = config_file("[store]\nwrite_policy = 'write-through'\n")
    other = tmp_path / "other.toml"
    other.write_text("[store]\nwrite_policy = 'selective'\n")

    assert load_config(env={"KVTIER_CONFIG": str(path)}).store.write_policy is (
        WritePolicy.WRITE_THROUGH)
    assert load_config(other, env={"KVTIER_CONFIG": str(path)}).store.write_policy is (
        WritePolicy.SELECTIVE)  # an explicit path wins over $KVTIER_CONFIG


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 * GiB), ("512MiB", 512 * MiB), ("1.5 GiB", 3 * GiB // 2), ("4096", 4096),
    ("2GB", 2 * 10**9),
])
def test_sizes_take_units(text: str, expected: int) -> None:
    assert load_config(env={"KVTIER_HOST_CAPACITY": text}).store.host.capacity_bytes == expected


def test_sizes_in_toml_may_be_plain_integers(config_file) -> None:
    path = config_file(f"[host]\ncapacity = {64 * MiB}\n[daemon]\nmax_frame_bytes = '1MiB'\n")

    config = load_config(path, env={})

    assert config.store.host.capacity_bytes == 64 * MiB
    assert config.max_frame_bytes == MiB


@pytest.mark.parametrize(("text", "expected"), [
    ("true", True), ("1", True), ("yes", True), ("On", True),
    ("false", False), ("0", False), ("no", False), ("OFF", False),
])
def test_booleans_from_the_environment(text: str, expected: bool) -> None:
    config = load_config(env={"KVTIER_HOST_PREFAULT": text, "KVTIER_DISK_ENABLED": text})

    assert config.store.host.prefault is expected
    assert config.store.disk.enabled is expected


def test_booleans_from_toml_and_flags(config_file) -> None:
    path = config_file("[host]\nprefault = false\n")

    assert load_config(path, env={}).store.host.prefault is False
    assert load_config(path, env={}, overrides={"host.prefault": True}).store.host.prefault


def test_allowed_uids_from_a_list_or_comma_separated(config_file) -> None:
    path = config_file("[daemon]\nallowed_uids = [1000, 1001]\n")

    assert load_config(path, env={}).allowed_uids == (1000, 1001)
    assert load_config(env={"KVTIER_DAEMON_ALLOWED_UIDS": "1000, 1002,"}).allowed_uids == (
        1000, 1002)
    assert load_config(env={"KVTIER_DAEMON_ALLOWED_UIDS": ""}).allowed_uids == ()


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_write_policy_is_an_enum(policy: WritePolicy) -> None:
    config = load_config(env={"KVTIER_STORE_WRITE_POLICY": policy.value})

    assert config.store.write_policy is policy


def test_paths_expand_the_home_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))

    config = load_config(env={"KVTIER_DISK_PATH": "~/kv", "KVTIER_DAEMON_SOCKET": "~/k.sock"})

    assert config.store.disk.path == tmp_path / "kv"
    assert config.socket_path == tmp_path / "k.sock"


def test_unknown_setting_in_the_file_suggests_one_and_lists_its_tables(config_file) -> None:
    path = config_file("[host]\ncapasity = '1GiB'\n")

    with pytest.raises(ConfigError) as error:
        load_config(path, env={})

    message = str(error.value)
    assert str(path) in message and "'host.capasity'" in message
    assert "did you mean 'host.capacity'?" in message
    host_settings = [name for name in SETTINGS if name.startswith("host.")]
    assert message.endswith(f"[host] has: {', '.join(host_settings)}")


def test_unknown_override_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(env={}, overrides={"host.size": 1})

    assert "command line" in str(error.value) and "'host.size'" in str(error.value)
    assert "host.capacity" in str(error.value)


def test_top_level_key_must_be_a_section(config_file) -> None:
    path = config_file("capacity = '1GiB'\n")

    with pytest.raises(ConfigError, match=r"top-level key 'capacity' must be a \[section\]"):
        load_config(path, env={})


@pytest.mark.parametrize(("text", "problem"), [
    ("[host\n", "cannot read config file"),
])
def test_unreadable_file_is_named(config_file, text: str, problem: str) -> None:
    path = config_file(text)

    with pytest.raises(ConfigError) as error:
        load_config(path, env={})

    assert problem in str(error.value) and str(path) in str(error.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file .*missing.toml"):
        load_config(tmp_path / "missing.toml", env={})


@pytest.mark.parametrize(("env", "names"), [
    ({"KVTIER_HOST_CAPACITY": "lots"}, ("host.capacity", "not a byte size")),
    ({"KVTIER_HOST_CAPACITY": "3 parsecs"}, ("host.capacity", "unknown size unit")),
    ({"KVTIER_HOST_PREFAULT": "maybe"}, ("host.prefault", "not a boolean")),
    ({"KVTIER_DAEMON_COPY_THREADS": "four"}, ("daemon.copy_threads", "not an integer")),
    ({"KVTIER_DAEMON_ALLOWED_UIDS": "1000,root"}, ("daemon.allowed_uids", "'root'")),
    ({"KVTIER_STORE_WRITE_POLICY": "write-sometimes"},
     ("store.write_policy", "write-through, write-back, selective")),
    ({"KVTIER_DAEMON_LOG_LEVEL": "loud"}, ("daemon.log_level", "unknown log level")),
])
def test_bad_environment_value_names_the_setting_and_its_source(env: dict,
                                                                names: tuple) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(env=env)

    assert str(error.value).startswith(f"environment: {names[0]}: ")
    assert names[1] in str(error.value)


def test_bad_file_value_names_the_setting_and_the_file(config_file) -> None:
    path = config_file("[daemon]\nallowed_uids = [1000, 'x']\n")

    with pytest.raises(ConfigError) as error:
        load_config(path, env={})

    assert str(error.value).startswith(f"{path}: daemon.allowed_uids: ")


def test_bad_flag_value_names_the_setting_and_the_command_line() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(env={}, overrides={"disk.capacity": "huge"})

    assert str(error.value).startswith("command line: disk.capacity: not a byte size")


def test_size_of_the_wrong_toml_type_names_the_setting(config_file) -> None:
    path = config_file("[host]\ncapacity = 1.5\n")

    with pytest.raises(ConfigError, match="host.capacity"):
        load_config(path, env={})


def test_boolean_is_not_a_size(config_file) -> None:
    path = config_file("[host]\ncapacity = true\n")

    with pytest.raises(ConfigError, match="host.capacity"):
        load_config(path, env={})


@pytest.mark.parametrize(("env", "name"), [
    ({"KVTIER_HOST_POLICY": "nope"}, "host.policy"),
    ({"KVTIER_HOST_CAPACITY": "0"}, "host.capacity"),
    ({"KVTIER_DAEMON_COPY_THREADS": "0"}, "daemon.copy_threads"),
])
def test_out_of_range_value_names_the_setting_and_its_source(env: dict, name: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(env=env)

    assert str(error.value).startswith(f"environment: {name}")


def test_remote_tier_is_off_by_default_and_configured_by_toml(config_file) -> None:
    assert not load_config(env={}).store.remote.enabled
    path = config_file('[remote]\nurl = "rediss://:pw@cache:6380/0"\nwrite = "evict"\n'
                       'timeout = 0.25\nttl = 86400\nbudget = "64GiB"\nkey_prefix = "node-a"\n')
    remote = load_config(path, env={}).store.remote
    assert remote.enabled and remote.url == "rediss://:pw@cache:6380/0"
    assert (remote.write, remote.timeout_s, remote.ttl_s, remote.budget_bytes,
            remote.key_prefix) == ("evict", 0.25, 86400, 64 * GiB, "node-a")


def test_remote_cluster_seeds_come_comma_separated_from_the_environment() -> None:
    seeds = "redis://10.0.0.1:7000,redis://10.0.0.2:7000"
    assert load_config(env={"KVTIER_REMOTE_URL": seeds}).store.remote.url == seeds


@pytest.mark.parametrize(("env", "problem"), [
    ({"KVTIER_REMOTE_URL": "http://cache:6379"}, "must start with redis://"),
    ({"KVTIER_REMOTE_WRITE": "sometimes"}, "remote write mode"),
    ({"KVTIER_REMOTE_TIMEOUT": "0"}, "positive number of seconds"),
    ({"KVTIER_REMOTE_TTL": "-1"}, "must not be negative"),
])
def test_bad_remote_values_name_the_setting_and_its_source(env: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as error:
        load_config(env=env)
    name = next(iter(env)).removeprefix("KVTIER_").lower().replace("_", ".", 1)
    assert str(error.value).startswith(f"environment: {name}: ")


def test_metrics_are_off_by_default_and_on_loopback_when_a_port_is_set(config_file) -> None:
    assert load_config(env={}).metrics_port is None
    config = load_config(env={"KVTIER_METRICS_PORT": "9464"})
    assert (config.metrics_port, config.metrics_address) == (9464, "127.0.0.1")
    config = load_config(config_file('[metrics]\nport = 9100\naddress = "::"\n'), env={})
    assert (config.metrics_port, config.metrics_address) == (9100, "::")


@pytest.mark.parametrize("env, problem", [
    ({"KVTIER_METRICS_PORT": "65536"}, "environment: metrics.port: port 65536 is out of range"),
    ({"KVTIER_METRICS_PORT": "9464.5"}, "environment: metrics.port: not a port number"),
    ({"KVTIER_METRICS_ADDRESS": "localhost"}, "environment: metrics.address: not an IP address"),
])
def test_bad_metrics_settings_name_the_setting(env: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(env=env)


def test_every_kvtier_variable_the_repository_reads_is_a_setting_or_known_not_to_be(
        caplog: pytest.LogCaptureFixture) -> None:
    """CI exports the suite's own KVTIER_* switches (KVTIER_REQUIRE_SGLANG, ...) to every daemon a
    test starts: one the settings do not know makes each daemon warn, and tests that read a
    daemon's only output line fail."""
    import re

    repo = Path(__file__).resolve().parents[1]
    sources = [p for folder in ("kvtier", "cli", "policies", "bench", "tests", ".ci")
               for p in (repo / folder).rglob("*") if p.is_file() and p.suffix in ("", ".py")]
    names = {name for p in sources
             for name in re.findall(r"\bKVTIER_[A-Z][A-Z0-9_]*[A-Z0-9]\b",
                                    p.read_text(errors="replace"))}
    names -= {"KVTIER_CONFIG"}  # a file to read, not a switch
    with caplog.at_level("WARNING", logger="kvtier.daemon.settings"):
        load_config(env={name: "1" for name in names
                         if name not in {d.env_name for d in SETTINGS.values()}})
    assert "unknown environment variable" not in caplog.text
