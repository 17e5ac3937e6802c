"""Drive an eviction policy through the calls the page store makes, for policy stories that
assert the exact order in which keys leave (tests/policies).

The store's call protocol is `kvtier.policies.base`'s: `on_miss`, `admit`, `choose_victim` until
there is room, `on_insert`; `on_access` on a hit. These helpers make those calls in that order
and report what left.

Verbs: `reference` (one key, every miss admitted and given room), `request` (a prefix chain as
one request: a refused key, or one no room can be made for, is not inserted), `drain` (evict
everything). A broken protocol (a refused key, no victim in a tier that must have one) raises
AssertionError, which a test runner reports as a failure.
"""

from __future__ import annotations

from kvtier.policies.base import CanEvict, EvictionPolicy, Key


def _any_key(key: Key) -> bool:
    return True


def reference(policy: EvictionPolicy, key: Key, can_evict: CanEvict = _any_key) -> list[Key]:
    """Look `key` up the way the page store does; return the keys evicted to make room for it.

    Raises:
        AssertionError: the policy refused `key`, or found no victim in a full tier.
    """
    if key in policy:
        policy.on_access(key)
        return []
    policy.on_miss(key)
    if not policy.admit(key):
        raise AssertionError(f"{type(policy).__name__} refused {key!r}")
    evicted: list[Key] = []
    while len(policy) >= policy.capacity_pages:
        victim = policy.choose_victim(can_evict)
        if victim is None:
            raise AssertionError(f"{type(policy).__name__} found no victim for {key!r}")
        evicted.append(victim)
    policy.on_insert(key)
    return evicted


def request(policy: EvictionPolicy, chain: list[Key], resident: set[Key],
            can_evict: CanEvict = _any_key) -> list[Key]:
    """Reference `chain` as one request, each key under the one before it (hits, then inserts
    of the misses) as the store does: a refused key, or one no room can be made for, is not
    inserted. `resident` (the caller's model of the tier) gains what was inserted and loses what
    was evicted. Return the evictions, in order."""
    evicted: list[Key] = []
    for index, key in enumerate(chain):
        if key in policy:
            policy.on_access(key)
            continue
        parent = chain[index - 1] if index else None
        policy.on_miss(key)
        if not policy.admit(key, parent):
            continue
        while len(policy) >= policy.capacity_pages:
            victim = policy.choose_victim(can_evict)
            if victim is None:
                break
            evicted.append(victim)
            resident.discard(victim)
        if len(policy) < policy.capacity_pages:
            policy.on_insert(key, parent)
            resident.add(key)
    return evicted


def drain(policy: EvictionPolicy) -> list[Key]:
    """Evict everything evictable, returning the order."""
    order: list[Key] = []
    while (victim := policy.choose_victim(_any_key)) is not None:
        order.append(victim)
    return order
