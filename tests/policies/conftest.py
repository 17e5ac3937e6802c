"""Randomized drivers shared by the policy tests: a policy's victims against a reference model of
its documented order (each test module holds its policy's model), a policy under random pins, and
random stores made in one call or a call per page."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

import pytest

from kvtier.policies import EvictionPolicy
from kvtier.policies.base import Key

Check = Callable[[EvictionPolicy], None]


class CacheModel(Protocol):
    """A plain reference of one policy's documented order, computed apart from the policy."""

    def miss(self, key: Key) -> None:
        """`key`, not resident, is about to be inserted."""

    def hit(self, key: Key) -> None:
        """Resident `key` was referenced."""

    def insert(self, key: Key) -> None:
        """`key` became resident."""

    def remove(self, key: Key) -> None:
        """Resident `key` left other than by eviction."""

    def evict(self) -> Key:
        """Forget and return the key the documented order evicts next."""


def _drive_against_model(policy: EvictionPolicy, model: CacheModel, seed: int, tail_factor: int,
                         check: Check | None = None, steps: int = 3000,
                         keys: Sequence[Key] | None = None) -> None:
    """Reference keys (a hot set plus a tail `tail_factor` times the capacity, or `keys` when
    given), deleting a few, and assert that every victim of the policy is the one `model` (fed
    the same calls, never the policy's answers) evicts."""
    rng = random.Random(seed)
    capacity = policy.capacity_pages
    resident: set[Key] = set()
    if keys is None:
        keys = [rng.randrange(capacity + 2) if rng.random() < 0.6
                else rng.randrange(tail_factor * capacity) for _ in range(steps)]
    for step, key in enumerate(keys):
        if rng.random() < 0.05 and resident:
            gone = rng.choice(sorted(resident))
            policy.on_remove(gone)
            model.remove(gone)
            resident.discard(gone)
        if key in resident:
            assert key in policy
            policy.on_access(key)
            model.hit(key)
        else:
            assert key not in policy
            policy.on_miss(key)
            model.miss(key)
            assert policy.admit(key)
            while len(resident) >= capacity:
                expected = model.evict()
                victim = policy.choose_victim(lambda k: True)
                assert victim == expected, f"step {step}: evicted {victim}, the model {expected}"
                resident.discard(victim)
            policy.on_insert(key)
            model.insert(key)
            resident.add(key)
        assert len(policy) == len(resident) and all(k in policy for k in resident)
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
    """`drive_against_model(policy, model, seed, tail_factor, check=None, keys=None)`: see
    `_drive_against_model`."""
    return _drive_against_model


@pytest.fixture
def drive_with_random_pins() -> Callable[..., None]:
    """`drive_with_random_pins(policy, seed, check=None)`: see `_drive_with_random_pins`."""
    return _drive_with_random_pins


def _store_randomly(policy: EvictionPolicy, seed: int, many: bool,
                   each_step: Callable[[int], None] | None = None) -> list[Key | None]:
    """Seeded requests (hits on a chain's resident pages, then its new pages stored, room made
    first with a few pages pinned, now and then a page removed between two victims); return the
    victims. `many`: each request's hits counted in one call, its store admitted in one call, its
    victims taken from one `victims` iterator, and its pages inserted in one call."""
    rng = random.Random(seed)
    chains = [[f"c{c}-0"] for c in range(10)]
    resident: set[Key] = set()
    victims: list[Key | None] = []
    for step in range(400):
        if each_step is not None:
            each_step(step)
        chain = chains[min(len(chains) - 1, int(rng.paretovariate(1.0)) - 1)]
        for _ in range(rng.randrange(4)):
            chain.append(f"{chain[0]}-{len(chain)}")
        hits = chain + chain[:1] * (step % 7 == 0)  # now and then a page hit twice
        if many:
            policy.on_access_many(hits)
        else:
            for key in hits:
                policy.on_access(key)
        pairs = [(key, chain[i - 1] if i else None) for i, key in enumerate(chain)
                 if key not in policy]
        entered = (policy.admit_many(pairs) if many
                   else [policy.admit(key, parent) for key, parent in pairs])
        admitted = [pair for pair, entering in zip(pairs, entered) if entering]
        pinned = set(rng.sample(sorted(resident), min(len(resident), 2)))
        in_order = policy.victims(lambda k: k not in pinned) if many else None
        while admitted and len(policy) + len(admitted) > policy.capacity_pages:
            victim = (next(in_order, None) if in_order is not None
                      else policy.choose_victim(lambda k: k not in pinned))
            victims.append(victim)
            if victim is None:
                admitted = admitted[:policy.capacity_pages - len(policy)]
                break
            resident.discard(victim)
            if step % 3 == 0 and resident - pinned:  # as the store drops a chunk's other pages
                gone = rng.choice(sorted(resident - pinned))
                policy.on_remove(gone)
                resident.discard(gone)
                victims.append(("removed", gone))
        if in_order is not None:
            in_order.close()
        if many:
            policy.on_insert_many(admitted)
        else:
            for key, parent in admitted:
                policy.on_insert(key, parent)
        resident.update(key for key, _ in admitted)
    return victims


@pytest.fixture
def store_randomly() -> Callable[..., list[Key | None]]:
    """`store_randomly(policy, seed, many, each_step=None)`: see `_store_randomly`."""
    return _store_randomly
