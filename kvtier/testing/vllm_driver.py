"""The vLLM driver (`kvtier.integrations.vllm.driver`) with fault injection, for tests:

    python -m kvtier.testing.vllm_driver --model DIR [the driver's arguments]

speaks the driver's protocol and answers one more command:

- `{"delete_after_lookup": true}`: from now on every page the scheduler finds in the daemon is
  deleted right after the lookup, before the worker recalls it (in-process mode only); `false`
  turns it off. The result is `{}`.

Start it with `DriverProcess(..., module=DRIVER_MODULE)`. Verbs: `main`, `delete_after_lookup`.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.integrations.vllm import driver

DRIVER_MODULE = "kvtier.testing.vllm_driver"


def delete_after_lookup(args: argparse.Namespace, enabled: bool) -> dict:
    """Wrap the scheduler's lookup so that the pages it finds are deleted before the recall
    (`enabled`), or unwrap it."""
    from kvtier.client import Client
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    # Patched on the class by name (setattr): a fault injected into vLLM's own calls, which a
    # type checker rightly refuses as a plain assignment to a method.
    original = getattr(SchedulerSide, "_kvtier_original_lookup",
                       SchedulerSide.num_new_matched_tokens)
    setattr(SchedulerSide, "_kvtier_original_lookup", original)
    if not enabled:
        setattr(SchedulerSide, "num_new_matched_tokens", original)
        return {}
    client = Client(args.socket or None, "driver-fault")

    def matched_then_deleted(self: Any, request: Any, num_computed_tokens: int) -> int:
        tokens = original(self, request, num_computed_tokens)
        if tokens:
            handle = client.open_namespace(self._geometry.namespace)
            first = num_computed_tokens // self._page_tokens
            client.delete(handle, self._tracked[request.request_id].keys[first:])
        return tokens

    setattr(SchedulerSide, "num_new_matched_tokens", matched_then_deleted)
    return {}


def main(argv: list[str] | None = None) -> None:
    """The driver's `main` with `delete_after_lookup` added."""
    driver.main(argv, {"delete_after_lookup": delete_after_lookup})


if __name__ == "__main__":
    main()
