"""Eviction and admission policies, installed as `kvtier.policies`.

`make_policy(name, capacity_pages)` builds one by name; `POLICY_NAMES` lists what exists.
"""

from __future__ import annotations

from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.arc import ArcPolicy
from kvtier.policies.base import CanEvict, EvictionPolicy, Key
from kvtier.policies.leader import LeaderPolicy
from kvtier.policies.lru import LruPolicy
from kvtier.policies.prefix import PrefixPolicy
from kvtier.policies.s3fifo import S3FifoPolicy

_POLICY_BY_NAME: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LruPolicy, ArcPolicy, S3FifoPolicy, PrefixPolicy, AdaptivePolicy,
                             LeaderPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(sorted(_POLICY_BY_NAME))


def make_policy(name: str, capacity_pages: int) -> EvictionPolicy:
    """Build the policy called `name` for a tier of `capacity_pages` pages.

    Raises:
        ValueError: `name` is not a known policy (the message lists the known ones).
    """
    try:
        cls = _POLICY_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        ) from None
    return cls(capacity_pages)


__all__ = ["AdaptivePolicy", "ArcPolicy", "CanEvict", "EvictionPolicy", "Key", "LeaderPolicy",
           "LruPolicy", "POLICY_NAMES", "PrefixPolicy", "S3FifoPolicy", "make_policy"]
