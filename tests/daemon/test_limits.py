"""The `daemon.*` limit settings: defaults, parsing, and refusal of values that would undo them."""

from __future__ import annotations

import pytest

from kvtier.daemon.limits import FdBudget, Limits
from kvtier.daemon.settings import load_config
from kvtier.errors import ConfigError


def test_limits_have_defaults_and_come_from_the_environment() -> None:
    assert load_config(env={}).limits == Limits()
    config = load_config(env={"KVTIER_DAEMON_MAX_CLIENTS": "3", "KVTIER_DAEMON_MAX_LEASE": "60s",
                              "KVTIER_DAEMON_MAX_BUFFERED_BYTES": "16MiB",
                              "KVTIER_DAEMON_FRAME_TIMEOUT": "0.5",
                              "KVTIER_DAEMON_SOCKET_GROUP": "kvtier"})
    assert (config.limits.max_clients, config.limits.max_lease_s) == (3, 60.0)
    assert (config.limits.max_buffered_bytes, config.limits.frame_timeout_s) == (16 << 20, 0.5)
    assert config.socket_group == "kvtier"


@pytest.mark.parametrize("env, says", [
    ({"KVTIER_DAEMON_MAX_LEASE": "inf"}, "daemon.max_lease must be a positive number"),
    ({"KVTIER_DAEMON_FRAME_TIMEOUT": "nan"}, "daemon.frame_timeout"),
    ({"KVTIER_DAEMON_MAX_CLIENTS": "0"}, "daemon.max_clients: must be at least 1"),
    ({"KVTIER_DAEMON_MAX_POOLS_PER_CLIENT": "x"}, "daemon.max_pools_per_client"),
])
def test_a_limit_that_would_undo_itself_is_refused(env: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(env=env)


def test_the_descriptor_budget_keeps_its_reserve() -> None:
    budget = FdBudget(fd_limit=300, reserve=256)
    assert [budget.try_take() for _ in range(45)].count(True) == 44
    budget.give_back(2)
    assert budget.try_take(2) and not budget.try_take()
