"""The connector's scheduler half: how much of a request the node holds, and the step's plans.

`num_new_matched_tokens` looks the request's full blocks up in the daemon (beyond vLLM's own
prefix-cache hit, and always leaving vLLM at least one token to compute); the pages found become
a recall plan once vLLM has allocated blocks for them. With `load_async` (the default) vLLM
parks the request until the workers report its pages landed, and runs the others meanwhile,
when there are others: `parks` says so while requests from earlier steps are running (with
`park` 'when_cheaper', only when holding them up would cost more: the running requests times
the copy's time against a step's, `kvtier.integrations.vllm.parking`). At an idle engine, and
with `load_async` off, the recall runs before the request's first forward, which costs the
copy alone; a parked request waits for a step to report its landing and another to run it.

Each step, `build_metadata` plans to store the blocks the step completes (all, or the prompt's
only, see `store_scope`), from the request's first block on, and with `skip_stored` drops those
the daemon holds already (one lookup per step for every request's blocks); a block vLLM had to
recompute (a failed recall, a preemption) is planned again, because planning restarts wherever
vLLM's computed count went back to. `request_finished` keeps a request's blocks allocated until
its stores are done.
Verbs: `num_new_matched_tokens`, `parks`, `after_alloc`, `build_metadata`, `recalls_timed`,
`request_finished`, `close`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from kvtier.client import Client, DaemonReplyError, PoolHandle
from kvtier.integrations.vllm.geometry import PageGeometry, request_keys
from kvtier.integrations.vllm.link import DaemonLink
from kvtier.integrations.vllm.options import ConnectorOptions, Park, StoreScope
from kvtier.integrations.vllm.parking import ParkingRule
from kvtier.integrations.vllm.plans import KvtierMetadata, PagePlan
from kvtier.keys import prefix_keys

# A child of vLLM's logger: the connector's lines show in the engine's log, in its format.
log = logging.getLogger("vllm.kvtier." + __name__.rsplit(".", 1)[-1])


@dataclass(slots=True)
class _Tracked:
    """What the scheduler half remembers of one request between steps."""

    request: Any
    keys: list[bytes] | None  # keys of the full blocks seen so far; None: kvtier stays out
    block_ids: list[int] = field(default_factory=list)
    num_local_pages: int = 0  # vLLM's own prefix-cache hit when kvtier was last asked
    num_found_pages: int = 0  # pages past it the daemon held when last asked
    num_planned_pages: int = 0  # blocks [0, this) have been planned for store
    has_stores: bool = False  # stores were sent since the request last (re)started
    parked: bool = False  # its recall was last asked for as asynchronous (see `parks`)


class SchedulerSide:
    """Plans recalls and stores for one vLLM engine's scheduler."""

    def __init__(self, geometry: PageGeometry, options: ConnectorOptions) -> None:
        self._geometry = geometry
        self._options = options
        self._page_tokens = geometry.namespace.page_tokens
        # Keys are chained under rank 0's namespace on every rank (the daemon keeps each
        # rank's pages apart by namespace): one key list serves every worker.
        self._key_namespace = geometry.for_rank(0)
        self._handles: list[PoolHandle] = []
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[PagePlan] = []  # allocated since the last step's metadata
        self._running: set[str] = set()  # scheduled in the last step and not finished since
        self._parking = ParkingRule(options.recall_gbps)
        self.num_loads_parked = 0  # recalls vLLM parked their requests for
        self.num_loads_before_forward = 0  # recalls the request's first forward waited for
        self.num_pages_planned = 0  # pages planned for store, before `skip_stored`
        self.num_pages_skipped = 0  # of them, pages the daemon held already
        self._link = DaemonLink(options.socket, f"vllm-scheduler-{os.getpid()}",
                                self._open_namespaces, options.reconnect_s, options.timeout_s,
                                poll_us=options.poll_us)

    def _open_namespaces(self, client: Client) -> None:
        world = self._geometry.namespace.tp_world_size
        self._handles = [client.open_namespace(self._geometry.for_rank(rank))
                         for rank in range(world)]

    def _keys(self, tracked: _Tracked) -> list[bytes] | None:
        """The request's keys, extended to every full block of its tokens so far."""
        keys = tracked.keys
        if keys is None:
            return None
        tokens = tracked.request.all_token_ids
        num_full = len(tokens) // self._page_tokens
        if num_full > len(keys):
            if keys:  # continue the chain from its last key: earlier blocks are hashed once
                keys += prefix_keys(self._key_namespace,
                                    tokens[len(keys) * self._page_tokens:
                                           num_full * self._page_tokens], keys[-1])
            else:
                keys += request_keys(self._key_namespace, tracked.request) or []
        return keys

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            first = request_keys(self._key_namespace, request)
            tracked = _Tracked(request, first)
            self._tracked[request.request_id] = tracked
        return tracked

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past vLLM's own `num_computed_tokens` whose pages the daemon holds."""
        tracked = self._track(request)
        tracked.num_local_pages = num_computed_tokens // self._page_tokens
        keys = self._keys(tracked)
        if not self._options.load or not keys:
            return 0
        usable = min(len(keys), (request.num_tokens - 1) // self._page_tokens)
        if usable <= tracked.num_local_pages:
            return 0
        try:
            hits = self._link.call(lambda client: min(
                client.lookup(handle, keys[:usable]).num_prefix for handle in self._handles))
        except DaemonReplyError as exc:
            log.warning("kvtier: lookup refused: %s", exc)
            return 0
        tracked.num_found_pages = max(0, (hits or 0) - tracked.num_local_pages)
        return tracked.num_found_pages * self._page_tokens

    def parks(self, request: Any) -> bool:
        """Whether vLLM should park `request` for its recall (asynchronous) rather than run the
        recall before its forward: only when asynchronous loads are on and other requests are
        running, whose steps a recall before the forward would hold up; with `park`
        'when_cheaper', only when they would wait longer for the copy than this one waits for
        a step (`ParkingRule`)."""
        tracked = self._track(request)
        num_others = len(self._running - {request.request_id})
        if self._options.park is Park.WHEN_CHEAPER:
            num_bytes = tracked.num_found_pages * self._geometry.namespace.page_bytes
            parks = self._parking.parks(num_bytes, num_others)
        else:
            parks = num_others > 0
        tracked.parked = self._options.load_async and parks
        return tracked.parked

    def recalls_timed(self, num_bytes: int, seconds: float, count: int) -> None:
        """`count` recalls of the workers since their last report moved `num_bytes` in
        `seconds`, summed over them."""
        first = not self._parking.num_reports
        self._parking.recalls_timed(num_bytes, seconds, count)
        if first and self._parking.num_reports:  # logged when it happens, as the first recalls
            self._log_recall_speed()

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated `block_ids` for the request: plan the recall of its external tokens."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens <= 0 or tracked.keys is None:
            return
        start = tracked.num_local_pages
        end = start + num_external_tokens // self._page_tokens
        self._pending_loads.append(PagePlan(request.request_id, tracked.keys[start:end],
                                            list(block_ids[start:end]), parked=tracked.parked))
        # The first of each kind is logged when it happens, and the counts at every power of
        # two from 16 recalls on: vLLM's server kills its engine process without `close`.
        if tracked.parked:
            self.num_loads_parked += 1
            if self.num_loads_parked == 1:
                log.info("kvtier: a recall parked its request (others were running)")
        else:
            self.num_loads_before_forward += 1
            if self.num_loads_before_forward == 1:
                log.info("kvtier: a recall ran before the forward (the engine was idle, or the "
                         "copy cost the running requests less than a step)")
        num_loads = self.num_loads_parked + self.num_loads_before_forward
        if num_loads >= 16 and not num_loads & (num_loads - 1):
            self._log_recalls()

    def build_metadata(self, scheduler_output: Any) -> KvtierMetadata:
        """This step's recalls and stores; resets the per-step state."""
        metadata = KvtierMetadata(preempted_req_ids=set(scheduler_output.preempted_req_ids or ()))
        # Every load vLLM allocated blocks for, whether the request runs this step (a
        # synchronous load) or waits for its pages (an asynchronous one).
        metadata.loads, self._pending_loads = self._pending_loads, []
        for req_id in metadata.preempted_req_ids:
            tracked = self._tracked.get(req_id)
            if tracked is not None:  # its stores end before its blocks are reused (worker)
                tracked.has_stores = False
        scheduled = scheduler_output.num_scheduled_tokens
        self._running = set(scheduled)
        self._parking.step_started(bool(scheduled))
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan(tracked, new.num_computed_tokens, scheduled.get(new.req_id, 0), metadata)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_block_ids = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_block_ids[0]) if new_block_ids else []
            elif new_block_ids:
                tracked.block_ids.extend(new_block_ids[0])
            self._plan(tracked, cached.num_computed_tokens[index], scheduled.get(req_id, 0),
                       metadata)
        if metadata.stores and self._options.skip_stored:
            metadata.stores = self._without_held(metadata.stores)
        for plan in metadata.stores:
            self._tracked[plan.req_id].has_stores = True
        return metadata

    def _without_held(self, plans: list[PagePlan]) -> list[PagePlan]:
        """`plans` less the pages the daemon holds on every rank: one lookup for them all."""
        keys = [key for plan in plans for key in plan.keys]
        try:
            tiers = self._link.call(lambda client: [client.lookup(handle, keys).tiers
                                                    for handle in self._handles])
        except DaemonReplyError as exc:
            log.warning("kvtier: lookup refused: %s", exc)
            tiers = None
        if tiers is None:
            return plans  # no daemon: the stores are dropped by the worker anyway
        held = [all(rank[i] is not None for rank in tiers) for i in range(len(keys))]
        kept: list[PagePlan] = []
        index = 0
        for plan in plans:
            run: PagePlan | None = None
            for i, (key, block_id) in enumerate(zip(plan.keys, plan.block_ids)):
                if held[index + i]:
                    run = None
                    continue
                if run is None:  # a run of missing pages: its parent is the key before it
                    parent = plan.keys[i - 1] if i else plan.parent_key
                    run = PagePlan(plan.req_id, [], [], parent)
                    kept.append(run)
                run.keys.append(key)
                run.block_ids.append(block_id)
            index += len(plan.keys)
        self.num_pages_skipped += sum(held)
        return kept

    def _plan(self, tracked: _Tracked, num_computed: int, num_scheduled: int,
              metadata: KvtierMetadata) -> None:
        options = self._options
        request = tracked.request
        if (not options.store or tracked.keys is None
                or request.num_prompt_tokens < options.store_min_tokens):
            return
        # Where vLLM went back to (a failed recall, a preemption), planning goes back too.
        start = min(tracked.num_planned_pages, num_computed // self._page_tokens)
        num_done = min(num_computed + num_scheduled, request.num_tokens)
        if options.store_scope is StoreScope.PROMPT:
            num_done = min(num_done, request.num_prompt_tokens)
        keys = self._keys(tracked) or []
        end = min(num_done // self._page_tokens, len(keys), len(tracked.block_ids))
        tracked.num_planned_pages = max(start, end)
        if end <= start:
            return
        metadata.stores.append(PagePlan(request.request_id, keys[start:end],
                                        tracked.block_ids[start:end],
                                        keys[start - 1] if start else None))
        self.num_pages_planned += end - start

    def _log_recalls(self) -> None:
        log.info("kvtier: %d recalls parked their requests, %d ran before the forward",
                 self.num_loads_parked, self.num_loads_before_forward)
        if self._parking.num_reports:
            self._log_recall_speed()

    def _log_recall_speed(self) -> None:
        parking = self._parking
        log.info("kvtier: recalls reached %.3f GB/s lately (%d reports), steps took %.1f ms",
                 parking.measured_bytes_per_s() / 1e9, parking.num_reports,
                 parking.step_estimate_s * 1e3)

    def request_finished(self, request: Any) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report its stores done."""
        self._running.discard(request.request_id)
        tracked = self._tracked.pop(request.request_id, None)
        return tracked is not None and tracked.has_stores

    def close(self) -> None:
        """Log what the stores skipped and how recalls ran, and disconnect from the daemon."""
        log.info("kvtier: %d pages planned for store, %d of them skipped (held already)",
                 self.num_pages_planned, self.num_pages_skipped)
        self._log_recalls()
        self._link.close()
