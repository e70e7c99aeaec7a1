"""Replay a trace through the server's own `Scheduler` and `KVCacheManager`, with a virtual clock in
place of the model, so the hit rates reported are the ones the server would get.

One step of the replay is the engine's step (step.run_step) with this replay as its executor:

    arrivals up to the clock ─► scheduler.add
    run_step: scheduler.schedule() ─► execute: the clock advances by the service model's time for the
              step's tokens; sampled: synthetic ids, unique per request (never shared), EOS ignored
              ─► scheduler.update(out, sampled, now) (commits, leases) ─► the tiers' page moves

Without arrivals the trace is replayed one request at a time. Closed-loop lines (`after`) are added
their delay after the request they follow finishes; a tool call's answer ends in an end-of-turn token,
and the engine's own tool_call_kv holds its conversation until the follow-up (with --tool-call-kv-ttl
above 0). Page moves carry no KV data, only the cache's bookkeeping. Leases (the trace's cache
breakpoints), the host tier (evicted pages kept and loaded back) and miss explanations are the engine's
own code too: `RunResult.requests` records what each request got, to compare with the engine request
by request.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field, fields

from kvserve.batch import PageOps, SampledToken, SchedulerOutput, StepResult
from kvserve.cache.hashing import split_namespace
from kvserve.cache.leases import Retention
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.offload import Offloader
from kvserve.cache.tiers import HostTier
from kvserve.config import EngineConfig
from kvserve.request import Request, RequestOutput, ToolCallKV
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import ADMISSION_AGE_BOUND_S, ADMISSION_SCAN_LIMIT, Scheduler
from kvserve.step import run_step
from kvserve.tool_call_kv import after_step
from kvserve.tools.simulate.requests import (END_OF_TURN_ID, GENERATED_ID_BASE, SimRequest, follow_ups,
                                           output_stride, pages_needed, synthetic_token, unbounded_pages)
_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


@dataclass(slots=True)
class ServiceModel:
    """How long a step takes: its prompt tokens at the prefill rate, plus one decode interval when it
    advances any request past its prompt (a batched decode step)."""

    prefill_tokens_per_s: float = 2000.0
    decode_tokens_per_s: float = 50.0  # per request

    def step_seconds(self, num_prompt_tokens: int, num_decode_seqs: int) -> float:
        decode = 1 / self.decode_tokens_per_s if num_decode_seqs else 0.0
        return num_prompt_tokens / self.prefill_tokens_per_s + decode


@dataclass(slots=True, frozen=True)
class SchedulerLimits:
    """The scheduler's knobs, defaulting to the engine's."""

    max_num_seqs: int = _ENGINE_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = _ENGINE_DEFAULTS["max_num_batched_tokens"]
    admission_age_bound_s: float = ADMISSION_AGE_BOUND_S


@dataclass(slots=True, frozen=True)
class CacheOptions:
    """The cache's knobs beyond the pool, defaulting to the engine's. `host_tier_pages`: pages of
    the host tier (the engine's --swap-space over its page size; 0: none)."""

    host_tier_pages: int = 0
    max_leased_fraction: float = _ENGINE_DEFAULTS["max_leased_fraction"]
    min_cacheable_tokens: int = _ENGINE_DEFAULTS["min_cacheable_tokens"]
    explain: bool = False  # every request's kv_explain
    tool_call_kv_ttl: float = _ENGINE_DEFAULTS["tool_call_kv_ttl"]  # holds while a tool runs; 0: off


@dataclass(slots=True, frozen=True)
class RequestRecord:
    """What one request got from the cache: the fields the engine's RequestOutput reports."""

    request_id: str
    num_cached_tokens: int
    cache_read_tokens: int = 0  # lease usage: cached tokens up to the last cacheable breakpoint
    cache_creation_tokens: int = 0  # tokens newly leased
    lease_refused: str | None = None
    miss_reason: str | None = None  # kv_explain's reason (with CacheOptions.explain)
    cached_by_source: tuple[tuple[str, int], ...] = ()  # kv_explain's, too

    @classmethod
    def of(cls, request: Request | RequestOutput) -> RequestRecord:
        """From the simulator's Request or the engine's finished RequestOutput (the same fields)."""
        usage, explained = request.lease_usage, request.kv_cache
        return cls(request.request_id, request.num_cached_tokens,
                   usage.cache_read_tokens if usage else 0,
                   sum(usage.cache_creation_tokens.values()) if usage else 0,
                   usage.refused if usage else None,
                   explained["reason"] if explained else None,
                   tuple(sorted(explained["cached_by_source"].items())) if explained else ())


@dataclass(slots=True)
class VirtualClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class RunResult:
    policy: str
    page_size: int
    capacity_tokens: int | None  # None: unbounded (no eviction can happen)
    num_pages: int  # usable pages
    hit_rate: float
    attainable_hit_rate: float  # this policy and page size with unbounded capacity, requests one at a time
    prefix_cache_queries: int
    prefix_cache_hits: int
    partial_page_hit_tokens: int  # hit tokens inside partly matched last pages (token-granular tails)
    num_evictions: int
    peak_pages_used: int
    peak_tokens_used: int
    num_requests_served: int
    num_requests_waited: int  # preempted, or left waiting while the pool could not hold their next chunk
    unservable_request_ids: list[str] = field(default_factory=list)
    num_preemptions: int = 0
    num_steps: int = 0
    duration_s: float = 0.0  # virtual time from the first arrival to the last finish
    requests: dict[str, RequestRecord] = field(default_factory=dict)  # by request id, served ones
    num_lease_grants: int = 0
    host_tier_hits: int = 0  # pages loaded back from the host tier
    follow_up_hit_rate: float | None = None  # cached / prompt tokens of the lines that continue a conversation
    num_follow_ups: int = 0
    tool_call_holds_granted: int = 0
    tool_call_holds_used: int = 0  # ended by the follow-up that read them
    num_used_pages_at_end: int = 0  # pages requests still hold after the replay (0: none leaked)


def replay(requests: list[SimRequest], policy: str, page_size: int, num_pages: int | None = None,
           service: ServiceModel | None = None, check_invariants: bool = False,
           limits: SchedulerLimits | None = None, cache: CacheOptions | None = None) -> RunResult:
    """Drive a fresh KVCacheManager and Scheduler with the trace; `num_pages` usable pages (None:
    unbounded)."""
    cache = cache or CacheOptions()
    capacity = None if num_pages is None else num_pages * page_size
    num_pages = unbounded_pages(requests, page_size) if num_pages is None else num_pages
    clock = VirtualClock((requests[0].arrival or 0.0) if requests else 0.0)
    host = HostTier(cache.host_tier_pages, 1)  # one "byte" per page: payloads are empty
    offload = Offloader.for_pool(page_size, host, prefix_caching=policy != "off", windowed=False)
    manager = KVCacheManager(num_pages + 1, page_size, policy, offload=offload,  # + the null page
                             max_leased_fraction=cache.max_leased_fraction, clock=clock)
    run = _Replay(requests, manager, service or ServiceModel(), limits or SchedulerLimits(), clock, cache)
    run.run()
    if check_invariants:
        manager.check_invariants()
        assert manager.num_used_pages == 0, "pages leaked after the replay"
    stats = manager.stats()
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    follow = [run.served[r.id] for r in follow_ups(requests) if r.id in run.served]
    follow_prompt = sum(r.num_prompt_tokens for r in follow)
    return RunResult(policy, page_size, capacity, num_pages, hits / queries if queries else 0.0, math.nan,
                     queries, hits, run.partial, stats.num_evictions, run.peak, run.peak * page_size,
                     len(requests) - len(run.unservable), len(run.waited), run.unservable,
                     run.scheduler.stats.num_preemptions, run.num_steps, run.clock.now - run.start,
                     {r.request_id: RequestRecord.of(r) for r in run.served.values()},
                     manager.leases.stats.grants, host.stats.offload_hits,
                     sum(r.num_cached_tokens for r in follow) / follow_prompt if follow_prompt else None, len(follow),
                     stats.leases.tool_call_lease_grants, stats.leases.tool_call_lease_used, manager.num_used_pages)


class _Replay:
    def __init__(self, requests: list[SimRequest], manager: KVCacheManager, service: ServiceModel,
                 limits: SchedulerLimits, clock: VirtualClock, cache: CacheOptions) -> None:
        self.requests, self.manager, self.service, self.limits = requests, manager, service, limits
        self.clock, self.cache = clock, cache
        self.start = self.clock.now
        self.served: dict[str, Request] = {}
        self.scheduler = Scheduler(
            manager, max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
            max_model_len=max((len(r.token_ids) + max(1, r.num_generated) for r in requests), default=2),
            preemption_mode="recompute", admission_age_bound_s=limits.admission_age_bound_s,
            clock=self.clock,
        )
        self.index = {r.id: i for i, r in enumerate(requests)}
        self.stride = output_stride(requests)
        self.sims = {r.id: r for r in requests}
        self.children: dict[str, list[SimRequest]] = defaultdict(list)
        for r in requests:
            if r.after is not None:
                self.children[r.after].append(r)
        self.due: list[tuple[float, int, SimRequest]] = []  # closed-loop lines, by the time they are sent
        self.partial = self.peak = self.num_steps = 0
        self.waited: set[str] = set()
        self._waiting: set[str] = set()  # waiting when the step began
        self.unservable: list[str] = []

    def run(self) -> None:
        pending = deque(r for r in self.requests if r.after is None)
        sequential = bool(pending) and pending[0].arrival is None
        max_steps = 100 * sum(len(r.token_ids) + r.num_generated for r in self.requests) + 1000
        while pending or self.due or self.scheduler.has_unfinished():
            if sequential and not self.scheduler.has_unfinished():
                self._add(pending.popleft())
            elif not sequential:
                if not self.scheduler.has_unfinished():
                    nexts = ([pending[0].arrival] if pending else []) + ([self.due[0][0]] if self.due else [])
                    self.clock.now = max(self.clock.now, min(nexts))
                while pending and pending[0].arrival <= self.clock.now:
                    self._add(pending.popleft())
                while self.due and self.due[0][0] <= self.clock.now:
                    self._add(heapq.heappop(self.due)[2])
            if self.scheduler.has_unfinished():
                self._step()
            assert self.num_steps <= max_steps, "the replay does not progress"

    def _add(self, r: SimRequest) -> None:
        if pages_needed(r, self.manager.page_size) > self.manager.num_pages - 1:
            self._unservable(r.id)  # larger than the whole pool
            return
        params = SamplingParams(max_tokens=max(1, r.num_generated), ignore_eos=not r.tool_call)
        tenant, salt = split_namespace(r.namespace)
        request = Request(request_id=r.id, prompt_token_ids=list(r.token_ids), sampling_params=params,
                          eos_token_id=END_OF_TURN_ID, tenant=tenant, cache_salt=salt, arrival_time=self.clock.now)
        parent = self.served.get(r.after) if r.continues else None
        answers = (parent.cache.held_lease_id,) if parent is not None and parent.cache.held_lease_id else ()
        hold = r.tool_call and self.cache.tool_call_kv_ttl > 0
        if hold or answers:  # as the server asks: hold this answer's KV, end the hold of the call it answers
            request.tool_call = ToolCallKV(hold=hold, answers=answers)
            request.hold_ttl_s = self.cache.tool_call_kv_ttl if hold else 0.0
        request.retention = Retention.of(list(r.breakpoints), len(r.token_ids), tenant,
                                         self.cache.min_cacheable_tokens)
        request.kv_explain = self.cache.explain
        self.served[r.id] = request
        self.scheduler.add(request)

    def _step(self) -> None:
        """One step.run_step, the engine's own, with this replay as its executor."""
        scheduler = self.scheduler
        self._waiting = {r.request_id for r in scheduler.waiting}
        step = run_step(scheduler, self, self.clock)
        self.num_steps += 1
        for request in step.changed:
            after_step(self.manager, request)  # the engine's own: holds while a tool runs
            if request.status.is_finished:
                for child in self.children.get(request.request_id, ()):
                    heapq.heappush(self.due, (self.clock.now + child.delay_s, self.index[child.id], child))
        self.waited.update(step.out.preempted)
        if not step.out.seqs and not scheduler.running and not step.out.preempted:
            self._drop_unadmittable()  # (one that preempted itself is admitted next step, leases giving way)

    # -- the executor: a virtual clock in place of the model (step.Executor) ---------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        """The step's time by the service model; sampled tokens unique per request (EOS ignored);
        no KV data (page moves carry empty payloads)."""
        scheduler = self.scheduler
        self.peak = max(self.peak, self.manager.num_used_pages)
        self._note_short_of_pages(out.num_tokens, len(out.seqs))
        num_prompt = num_decode = 0
        sampled: list[SampledToken | None] = []
        for seq in out.seqs:
            request = scheduler.requests[seq.request_id]
            if seq.request_id in self._waiting:  # admitted now: it starts at its prefix hit
                self.partial += seq.start_pos % self.manager.page_size
            if seq.start_pos >= request.num_prompt_tokens and len(seq.token_ids) == 1:
                num_decode += 1  # (a recompute after preemption runs at the prefill rate)
            else:
                num_prompt += len(seq.token_ids)
            sampled.append(SampledToken(self._next_token(request)) if seq.need_sample else None)
        self.clock.now += self.service.step_seconds(num_prompt, num_decode)
        return StepResult(sampled, self.apply_page_ops(out.page_ops))

    def apply_page_ops(self, ops: PageOps) -> list[bytearray]:
        return [bytearray() for _ in ops.saves]  # (empty pages; the tiers copy what they keep)

    def _next_token(self, request: Request) -> int:
        r = self.sims[request.request_id]
        return synthetic_token(self.index[r.id], self.stride, r, request.num_output_tokens)

    def _unservable(self, request_id: str) -> None:
        """Never served, and neither are the closed-loop lines that would follow it."""
        self.unservable.append(request_id)
        for child in self.children.get(request_id, ()):
            self._unservable(child.id)

    def _first_chunk_is_short(self, request: Request, budget: int) -> tuple[bool, bool]:
        """(short of pages now, short even with every idle cached page of its hit counted free)."""
        ps = self.manager.page_size
        hit = self.manager.lookup(request.token_ids, request.namespace)
        end = min(request.num_tokens, hit.num_tokens + budget)
        need = -(-end // ps) - hit.num_tokens // ps
        idle = sum(1 for page in hit.pages if self.manager.pool.ref(page) == 0)
        free = self.manager.num_free_pages
        return need > free, need > free - idle

    def _note_short_of_pages(self, num_tokens: int, num_seqs: int) -> None:
        """Waiting requests the pool could not hold (their first chunk) while seats and budget were left."""
        budget = self.limits.max_num_batched_tokens - num_tokens
        if budget <= 0 or num_seqs >= self.limits.max_num_seqs:
            return
        for i, request in enumerate(self.scheduler.waiting):
            if i == ADMISSION_SCAN_LIMIT:
                break
            if request.request_id not in self.waited and self._first_chunk_is_short(request, budget)[0]:
                self.waited.add(request.request_id)

    def _drop_unadmittable(self) -> None:
        """Nothing runs and nothing was admitted: the waiting requests whose first chunk cannot get
        pages even in the empty pool (a reused idle hit page costs one) are unservable here. The engine
        raises an error in this state; the report counts them."""
        budget = self.limits.max_num_batched_tokens
        stuck = [r for r in self.scheduler.waiting if self._first_chunk_is_short(r, budget)[1]]
        if not stuck:
            raise RuntimeError("the simulated scheduler admitted nothing although no request runs")
        for request in stuck:
            self.scheduler.abort(request.request_id)
            self._unservable(request.request_id)
            self.served.pop(request.request_id, None)
