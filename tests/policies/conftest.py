"""Randomized drivers shared by the policy tests: a policy against a simulated cache."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvtier.policies import EvictionPolicy

Check = Callable[[EvictionPolicy], None]


def _drive_against_model(policy: EvictionPolicy, seed: int, tail_factor: int,
                         check: Check | None = None, steps: int = 3000) -> None:
    """Reference keys (a hot set plus a tail `tail_factor` times the capacity), deleting a few,
    and assert the policy's resident set always equals a simulated cache of its capacity."""
    rng = random.Random(seed)
    capacity = policy.capacity_pages
    resident: set[int] = set()
    for _ in range(steps):
        key = rng.randrange(capacity + 2) if rng.random() < 0.6 else rng.randrange(
            tail_factor * capacity)
        if rng.random() < 0.05 and resident:
            gone = rng.choice(sorted(resident))
            policy.on_remove(gone)
            resident.discard(gone)
        if key in policy:
            assert key in resident
            policy.on_access(key)
        else:
            assert key not in resident
            policy.on_miss(key)
            assert policy.admit(key)
            while len(policy) >= capacity:
                victim = policy.choose_victim(lambda k: True)
                assert victim in resident
                resident.discard(victim)
            policy.on_insert(key)
            resident.add(key)
        assert len(policy) <= capacity
        assert {k for k in resident if k in policy} == resident and len(policy) == len(resident)
        if check is not None:
            check(policy)


def _drive_with_random_pins(policy: EvictionPolicy, seed: int, check: Check | None = None,
                            steps: int = 2000) -> None:
    """Insert under random pins: a victim is never pinned, and None only when all are pinned."""
    rng = random.Random(seed)
    capacity = policy.capacity_pages
    for _ in range(steps):
        key = rng.randrange(3 * capacity)
        pinned = {k for k in range(3 * capacity) if rng.random() < 0.5}
        if key in policy:
            policy.on_access(key)
            continue
        policy.on_miss(key)
        full = len(policy) >= capacity
        victim = policy.choose_victim(lambda k: k not in pinned) if full else None
        if full and victim is None:
            assert all(k in pinned for k in range(3 * capacity) if k in policy)
            continue
        assert victim is None or (victim not in pinned and victim not in policy)
        policy.on_insert(key)
        assert len(policy) <= capacity
        if check is not None:
            check(policy)


@pytest.fixture
def drive_against_model() -> Callable[..., None]:
    """`drive_against_model(policy, seed, tail_factor, check=None)`: see `_drive_against_model`."""
    return _drive_against_model


@pytest.fixture
def drive_with_random_pins() -> Callable[..., None]:
    """`drive_with_random_pins(policy, seed, check=None)`: see `_drive_with_random_pins`."""
    return _drive_with_random_pins
