"""Continuous batching: each step, decide which tokens of which requests the model computes.

There are no prefill or decode phases. Every request has `num_computed_tokens` catching up with
`len(token_ids)` under a per-step token budget; a prompt longer than the budget is computed in
chunks, a prefix-cache hit simply starts the counter further along, and a request preempted by
recompute starts again from zero (or from its cached prefix). Running requests are served first, in
admission order; when a running request needs a page and none is free, the most recently admitted
request is preempted. Then waiting requests are admitted while pages, sequence slots and budget last.
The scheduler sees pages only through KVCacheManager: what an admitted request reuses (pool, window,
tiers) is the manager's one answer (`plan_admission`), swap-out and swap-in are the manager's; the page moves it decides travel in
SchedulerOutput.page_ops for the runner to apply.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from kvserve.batch import SampledToken, ScheduledSeq, SchedulerOutput
from kvserve.cache.hashing import common_prefix_len
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.sequence import Allocation, PrefixHit
from kvserve.config import PreemptionMode, PrefixCachePolicy
from kvserve.request import CacheOutcome, Request, RequestStatus
from kvserve.speculative_config import SpeculativeConfig
from kvserve.speculative.policy import Drafts, SpecPolicy

ADMISSION_SCAN_LIMIT = 256  # waiting requests looked at per step for cache-aware ordering
MAX_PREEMPTIONS = 3  # a request preempted more often than this stops new admissions until it ends
ADMISSION_AGE_BOUND_S = 10.0  # a request waiting longer is admitted in arrival order, not by its hit


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemption_loop_guards: int = 0  # requests that crossed max_preemptions (admissions held)


@dataclass(frozen=True, slots=True)
class SchedulerCounts:
    """A read of the scheduler's queues and counters (engine_stats.EngineStats.scheduler)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # of admitted requests (first admission only)
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    num_preemption_loop_guards: int = 0


class Scheduler:
    def __init__(self, manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, preemption_mode: str = "recompute",
                 admission_age_bound_s: float = ADMISSION_AGE_BOUND_S,
                 clock: Callable[[], float] = time.monotonic,
                 max_preemptions: int = MAX_PREEMPTIONS,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self.manager = manager
        # speculative decoding: draft tokens for decoding requests (speculative/policy.py), None when off
        self.spec = SpecPolicy(speculative_config, manager.page_size, manager.num_pages,
                               max_num_batched_tokens) if speculative_config else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption_mode = PreemptionMode(preemption_mode)
        self.clock = clock  # admission aging; the simulator passes its virtual clock
        self.max_preemptions = max_preemptions
        self.looping: set[str] = set()  # requests preempted past max_preemptions, until they end
        self.admission_age_bound_s = admission_age_bound_s
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self.swapped: deque[Request] = deque()  # pages in the host tier, oldest first
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    def counts(self) -> SchedulerCounts:
        stats = self.stats
        return SchedulerCounts(len(self.running), len(self.waiting), len(self.swapped), stats.num_preemptions,
                               stats.prompt_tokens, stats.cached_prompt_tokens, stats.generation_tokens,
                               stats.num_preemption_loop_guards)

    # -- requests in and out -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; its fork children (n > 1) wait on it, or queue too if there is no
        prompt page to share (a one-token prompt)."""
        self.requests[request.request_id] = request
        self.waiting.append(request)
        for child in request.fork_children:
            self.requests[child.request_id] = child
        if request.num_prompt_tokens < 2:
            self.waiting.extend(request.fork_children)
            request.fork_children = []

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.swapped:
            self._swap_in(out)
        preempted = False
        speculate = self.spec is not None and self.spec.wants_drafts(len(self.running))
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.fork_children and request.num_computed_tokens == request.num_prompt_tokens - 1:
                self._fork(request)
            num_new = self._chunk(request, request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget) if speculate and num_new == 1 else None
            num_drafts = drafts.num_tokens if drafts else 0
            end = request.num_computed_tokens + num_new + num_drafts
            copies = self.manager.append(request.request_id, request.num_computed_tokens, end)
            if copies is None and num_drafts:  # (nothing changed) the decode token alone, as without drafts
                drafts, num_drafts, end = None, 0, end - num_drafts
                copies = self.manager.append(request.request_id, request.num_computed_tokens, end)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
                copies = self.manager.append(request.request_id, request.num_computed_tokens, end)
            if copies is None:
                break  # the request preempted itself: nobody after it is left
            out.page_ops.copies.extend(copies)
            out.seqs.append(self._seq(request, num_new, self.spec.start(request, drafts) if drafts else None))
            budget -= num_new + num_drafts
            index += 1
        if not preempted and not self.swapped:
            self._admit(out, budget)
        out.page_ops.saves, out.page_ops.loads = self.manager.tiers.take_page_moves()
        out.page_ops.window_copies = self.manager.take_window_copies()
        return out

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """Tokens to compute this step. A fork parent stops one token short of its prompt's end,
        so its children can share every prompt page before anyone writes the last one."""
        num_new = min(request.num_tokens - start, budget)
        if request.fork_children:
            num_new = min(num_new, request.num_prompt_tokens - 1 - start)
        return num_new

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        for request, hit in self._admission_order():
            if self.looping and request.request_id not in self.looping:
                continue  # the preemption-loop guard: nobody new until the looping request ends
            seats = 1 + len(request.fork_children)
            if budget <= 0 or len(self.running) + seats > self.max_num_seqs:
                break
            limit = request.num_tokens - (2 if request.fork_children else 1)  # a fork parent computes 2
            hit = self.manager.plan_admission(request.token_ids, request.namespace, limit, budget, hit)
            end = hit.num_cached_tokens + self._chunk(request, hit.num_cached_tokens, budget)
            got = self.manager.allocate(request.request_id, request.token_ids, request.namespace, hit, end)
            while got is None and not self.running and self.manager.make_room():
                got = self.manager.allocate(request.request_id, request.token_ids,
                                            request.namespace, hit, end)  # leases gave way
            if got is None:
                break  # not enough pages now; nobody behind it overtakes it
            start = got.num_cached_tokens  # less than the plan's where its pages were evicted since
            num_new = min(end - start, budget)
            self.waiting.remove(request)
            if request.num_preemptions == 0:
                self._first_admission(request, got)
            request.num_computed_tokens = start
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.page_ops.copies.extend(got.copies)
            out.seqs.append(self._seq(request, num_new))
            budget -= num_new

    def _first_admission(self, request: Request, got: Allocation) -> None:
        """What the request got from the cache, kept on it (request.cache), and counted."""
        below_min = request.retention.below_min_cacheable if request.retention is not None else None
        request.cache = CacheOutcome(got.num_cached_tokens, dict(got.cached_by_source))
        if request.kv_explain:
            request.cache.explanation = self.manager.explain(request.token_ids, request.namespace, got, below_min)
        if request.retention is not None:  # what it read, for its lease usage
            request.retention = replace(request.retention, num_cached_tokens=got.num_cached_tokens)
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.stats.cached_prompt_tokens += min(got.num_cached_tokens, request.num_prompt_tokens)

    def _fork(self, parent: Request) -> None:
        for child in parent.fork_children:
            self.manager.fork(parent.request_id, child.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.cache = CacheOutcome(parent.cache.num_cached_tokens, dict(parent.cache.cached_by_source))
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        parent.fork_children = []

    def _admission_order(self) -> Iterator[tuple[Request, PrefixHit]]:
        """Cache-aware order. With the prefix cache off: FCFS. Otherwise requests that waited past the
        age bound (or were preempted) go first in arrival order, then the rest by longest cached
        prefix. A request whose uncached prefix (at least a page of it) is being computed right now
        by a running request waits a step: it will hit once those pages are committed."""
        if self.manager.policy is PrefixCachePolicy.OFF:
            for request in list(self.waiting):
                yield request, self.manager.lookup(request.token_ids, request.namespace)
            return
        now = self.clock()
        candidates = list(itertools.islice(self.waiting, ADMISSION_SCAN_LIMIT))
        hits = {r.request_id: self.manager.lookup(r.token_ids, r.namespace) for r in candidates}

        def priority(item: tuple[int, Request]) -> tuple:
            position, request = item
            aged = request.num_preemptions > 0 or now - request.arrival_time > self.admission_age_bound_s
            return (0, position) if aged else (1, -hits[request.request_id].num_tokens, position)

        for _, request in sorted(enumerate(candidates), key=priority):
            hit = hits[request.request_id]
            if self._shares_prefix_in_flight(request, hit):
                continue
            yield request, hit

    def _shares_prefix_in_flight(self, request: Request, hit: PrefixHit) -> bool:
        page_size = self.manager.page_size
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens or other.namespace != request.namespace:
                continue  # only requests still computing their prompt will commit new prefix pages
            common = common_prefix_len(request.token_ids, other.prompt_token_ids)
            if common - hit.num_tokens >= page_size:
                return True
        return False

    def _drafts(self, request: Request, budget: int) -> Drafts | None:
        """Drafts after the request's decode token (speculative/policy.py), into pages free of cached
        content with a page of headroom kept for every running request."""
        spare = self.manager.num_spare_pages - len(self.running)
        return self.spec.drafts(request, budget, self.max_model_len, spare) if spare > 0 else None

    def _seq(self, request: Request, num_new: int, drafts: Drafts | None = None) -> ScheduledSeq:
        start, params = request.num_computed_tokens, request.sampling_params
        known = drafts.token_ids if drafts else []  # (a draft model's come from the runner)
        samples = start + num_new == request.num_tokens  # the chunk ends at the last known token
        return ScheduledSeq(
            request_id=request.request_id, token_ids=request.token_ids[start:start + num_new] + known,
            start_pos=start,
            block_table=self.manager.block_table(request.request_id),
            need_sample=samples,
            sampling_params=params,
            num_output_tokens=request.num_output_tokens,
            window_block_table=self.manager.window_block_table(request.request_id),
            draft_token_ids=list(known),
            grammar=request.grammar if samples else None,
            draft=drafts.work if drafts else None,
            output_token_ids=request.output_token_ids if params.penalizes and samples else None,
            repetition_token_ids=params.repetition_tokens(request.token_ids) if samples else None,
            masked_token_ids=request.masked_token_ids() if samples else None,
            prompt_targets=request.prompt_targets(start, num_new))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Swap the pages to the host tier when asked and there is room; otherwise recompute: drop the
        pages (full ones stay in the prefix cache) and requeue the request at the front."""
        self.running.remove(request)
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        if request.num_preemptions == self.max_preemptions + 1:  # a preemption loop: let it finish
            self.looping.add(request.request_id)
            self.stats.num_preemption_loop_guards += 1
        out.preempted.append(request.request_id)
        if self.spec is not None:
            self.spec.preempted(request.request_id)  # (the draft model's K/V is recomputed)
        if (self.preemption_mode is PreemptionMode.SWAP and not request.fork_children
                and self.manager.tiers.swap_out(request.request_id)):
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        self.manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _swap_in(self, out: SchedulerOutput) -> None:
        """Bring swapped requests back, oldest first, when their pages fit with a page of headroom for
        every running request's next token (so they are not swapped straight out again)."""
        while self.swapped and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            num_pages = self.manager.tiers.num_swapped_pages(request.request_id)
            if self.manager.num_free_pages < num_pages + len(self.running) + 1:
                return
            if not self.manager.tiers.swap_in(request.request_id, request.namespace):
                return
            self.swapped.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    # -- results -------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[SampledToken | None], now: float,
               accepted: list[list[SampledToken]] | None = None) -> list[Request]:
        """Advance counters, append sampled tokens, apply length/EOS rules, free finished requests.
        `accepted`: per seq, the draft tokens verification kept (before its sampled token).
        Returns the requests that got a new token (finished ones included)."""
        changed: list[Request] = []
        for i, (seq, token) in enumerate(zip(out.seqs, sampled)):
            request = self.requests.get(seq.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            reason, kept = None, accepted[i] if accepted else []
            if seq.draft is not None:
                self.spec.verified(request.request_id, seq.draft, len(kept))
            if seq.num_drafts:
                reason = self._take_speculated(request, seq, kept, token, now)
            else:
                request.num_computed_tokens += len(seq.token_ids)
                if token is not None:
                    self._append_token(request, token, now)
                    reason = request.stop_after_token(self.max_model_len)
            if token is not None:
                changed.append(request)
            retention = request.retention if request.lease_usage is None else None
            granted = self.manager.commit(request.request_id, request.token_ids, request.num_computed_tokens,
                                          retention)
            if granted is not None:  # the prompt is committed: the cache leased its breakpoints
                request.cache.lease_usage = granted
            if reason is not None:
                self._finish(request, reason, now)
        return changed

    def _append_token(self, request: Request, token: SampledToken, now: float) -> None:
        request.append_output(token.token_id)
        if token.top_logprobs is not None or token.logprob is not None:
            request.logprobs.append({token.token_id: token.logprob or 0.0, **(token.top_logprobs or {})})
        self.stats.generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now

    def _take_speculated(self, request: Request, seq: ScheduledSeq, accepted: list[SampledToken],
                         token: SampledToken, now: float) -> RequestStatus | None:
        """A verified draft: the accepted tokens, then the sampled one, each under the stop rules. The
        K/V of the rest is rolled back: the sequence has computed every kept token but its last, as
        if it had decoded them one by one. Returns the stop reason, if one applied."""
        reason = None
        for kept in [*accepted, token]:
            self._append_token(request, kept, now)
            reason = request.stop_after_token(self.max_model_len)
            if reason is not None:
                break
        request.num_computed_tokens = request.num_tokens - 1
        self.manager.truncate(request.request_id, request.num_computed_tokens)
        self.spec.record(request, seq.num_drafts, len(accepted))
        return reason

    def finish(self, request_id: str, status: RequestStatus, now: float | None = None) -> None:
        """Called by the engine for stop strings, which need the detokenized text."""
        request = self.requests.get(request_id)
        if request is not None and not request.status.is_finished:
            self._finish(request, status, now)

    def _finish(self, request: Request, status: RequestStatus, now: float | None = None) -> None:
        self.looping.discard(request.request_id)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.manager.tiers.drop_swap(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        for child in request.fork_children:  # never forked: they end with their parent
            child.status = status
            child.finish_time = self.clock() if now is None else now
            self.requests.pop(child.request_id, None)
        request.fork_children = []
        if self.manager.has_seq(request.request_id):
            self.manager.free(request.request_id)
        request.status = status
        request.finish_time = self.clock() if now is None else now
        del self.requests[request.request_id]

