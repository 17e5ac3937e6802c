"""The policy registry: names map to classes, and bad input is refused with a useful message."""

from __future__ import annotations

import pytest

from kvtier.policies import (
    POLICY_NAMES,
    AdaptivePolicy,
    ArcPolicy,
    EvictionPolicy,
    LeaderPolicy,
    LruPolicy,
    PrefixPolicy,
    S3FifoPolicy,
    make_policy,
)

EXPECTED_CLASS_BY_NAME: dict[str, type[EvictionPolicy]] = {
    "lru": LruPolicy,
    "arc": ArcPolicy,
    "s3fifo": S3FifoPolicy,
    "prefix": PrefixPolicy,
    "adaptive": AdaptivePolicy,
    "leader": LeaderPolicy,
}


def test_every_known_name_is_listed() -> None:
    assert set(POLICY_NAMES) == set(EXPECTED_CLASS_BY_NAME)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_make_policy_builds_the_named_class(name: str) -> None:
    policy = make_policy(name, 8)
    assert type(policy) is EXPECTED_CLASS_BY_NAME[name]
    assert policy.name == name
    assert policy.capacity_pages == 8
    assert len(policy) == 0


def test_an_unknown_name_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError) as excinfo:
        make_policy("mru", 8)
    message = str(excinfo.value)
    assert "mru" in message
    for name in POLICY_NAMES:
        assert name in message


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("capacity_pages", [0, -1])
def test_a_capacity_below_one_is_refused(name: str, capacity_pages: int) -> None:
    with pytest.raises(ValueError, match="capacity_pages"):
        make_policy(name, capacity_pages)
