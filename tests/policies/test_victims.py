"""Victims one after another (`EvictionPolicy.victims`): what the caller refuses keeps its place,
and the iterator evicts only as far as it is asked."""

from __future__ import annotations

import pytest

from kvtier.policies import EvictionPolicy, make_policy
from kvtier.testing.policies import drain, request

NAMES = ["lru", "prefix", "adaptive", "arc", "s3fifo", "leader"]
KEEP_THEIR_PLACE = [name for name in NAMES if name != "s3fifo"]  # S3-FIFO requeues a pinned key


def two_chains(name: str) -> EvictionPolicy:
    """A tier of 8 holding two requests of 4 pages each."""
    policy = make_policy(name, 8)
    resident: set[str] = set()
    for chain in (["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"]):
        request(policy, chain, resident)
    return policy


@pytest.mark.parametrize("name", KEEP_THEIR_PLACE)
def test_a_key_refused_while_victims_are_taken_is_the_next_one_once_allowed(name: str) -> None:
    first = two_chains(name).choose_victim(lambda k: True)
    policy = two_chains(name)
    in_order = policy.victims(lambda k: k != first)
    taken = [next(in_order), next(in_order)]
    in_order.close()
    assert first not in taken and first in policy and not any(k in policy for k in taken)
    assert drain(policy)[0] == first
    assert len(policy) == 0


@pytest.mark.parametrize("name", NAMES)
def test_victims_evicts_only_what_is_taken(name: str) -> None:
    policy = two_chains(name)
    in_order = policy.victims(lambda k: True)
    assert len(policy) == 8  # nothing yet
    victim = next(in_order)
    in_order.close()
    assert victim not in policy and len(policy) == 7
