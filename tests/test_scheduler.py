"""The scheduler and the cache manager, driven with no model: a fake runner stores token ids as its
"KV" through the slot mapping and answers with a function of the context it reads back through the
block table. Any wrong page (a bad prefix hit, a missed copy-on-write, a page reused while still
referenced) changes the answer, so outputs must equal the reference computed from the tokens alone,
whatever the page size, pool size, budget, prefix policy or preemption."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.batch import PageOps, SchedulerOutput, StepResult
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.offload import Offloader
from kvserve.cache.tiers import HostTier
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler

VOCAB = 1000


def next_token(context: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 % VOCAB


@dataclass
class FakeSample:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.pages = [[-1] * page_size for _ in range(num_pages)]

    def apply_page_ops(self, ops: PageOps) -> list[list[int]]:
        """The real runner's order: saves (read), loads, copies."""
        saved = [list(self.pages[page]) for page, _ in ops.saves]
        for page, content in ops.loads:
            self.pages[page] = list(content)
        for src, dst in ops.copies:
            self.pages[dst] = list(self.pages[src])
        return saved

    def execute(self, out: SchedulerOutput) -> StepResult:
        saved = self.apply_page_ops(out.page_ops)
        results: list[FakeSample | None] = []
        for seq in out.seqs:
            assert 0 not in seq.block_table, "the null page was handed out"
            for i, token in enumerate(seq.token_ids):
                pos = seq.start_pos + i
                self.pages[seq.block_table[pos // self.page_size]][pos % self.page_size] = token
            if not seq.need_sample:
                results.append(None)
                continue
            end = seq.start_pos + len(seq.token_ids)
            context = [self.pages[seq.block_table[p // self.page_size]][p % self.page_size]
                       for p in range(end)]
            results.append(FakeSample(next_token(context)))
        return StepResult(results, saved)


def finish_step(scheduler: Scheduler, runner: FakeRunner, out: SchedulerOutput, now: float) -> None:
    """The rest of an engine step after schedule(), as LLMEngine.step does it: execute (page moves
    first), hand the saved payloads to the cache layer, update, flush the pages committed for a
    shared tier."""
    result = runner.execute(out)
    scheduler.manager.tiers.complete(out.page_ops.saves, result.saved)
    scheduler.update(out, result.sampled, now)
    saves, loads = scheduler.manager.tiers.take_page_moves()
    assert not loads, "update loads nothing"
    scheduler.manager.tiers.complete(saves, runner.apply_page_ops(PageOps(saves)))


@dataclass
class Run:
    requests: list[Request]
    manager: KVCacheManager
    scheduler: Scheduler
    peak_used_pages: int

    def __iter__(self):
        return iter((self.requests, self.manager, self.scheduler))


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def run(prompts: list[list[int]], max_tokens: int, *, num_pages: int, page_size: int,
        policy: str, budget: int, max_num_seqs: int = 8, namespaces: list[str] | None = None,
        preemption_mode: str = "recompute", swap_pages: int = 64, n: int = 1):
    host = HostTier(capacity_bytes=swap_pages, page_bytes=1)
    manager = KVCacheManager(num_pages, page_size, policy, offload=Offloader(page_size, host))
    scheduler = Scheduler(manager, max_num_seqs, budget, max_model_len=10_000,
                          preemption_mode=preemption_mode)
    runner = FakeRunner(num_pages, page_size)
    requests = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        samples = [Request(f"r{i}#{k}", prompt, params, cache_salt=(namespaces or [""] * len(prompts))[i])
                   for k in range(n)]
        samples[0].fork_children = samples[1:]
        scheduler.add(samples[0])
        requests.extend(samples)
    steps = peak = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        peak = max(peak, manager.num_used_pages)
        assert out.seqs, "no progress"
        assert out.num_tokens <= budget
        finish_step(scheduler, runner, out, now=float(steps))
        manager.check_invariants()
        steps += 1
        assert steps < 10_000
    assert manager.num_used_pages == 0
    assert host.num_swapped_pages == 0
    return Run(requests, manager, scheduler, peak)


def shared_prefix_prompts(n: int, prefix_len: int, tail_len: int) -> list[list[int]]:
    prefix = [(7 * i) % 500 + 1 for i in range(prefix_len)]
    return [prefix + [(i * 31 + j) % 500 + 1 for j in range(tail_len)] for i in range(n)]


def test_chunked_prefill_respects_the_budget_and_gives_the_reference():
    prompts = shared_prefix_prompts(4, 100, 20)
    requests, _, _ = run(prompts, 10, num_pages=200, page_size=16, policy="off", budget=32)
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == reference(prompt, 10)


def test_shared_prefix_is_computed_once_and_later_requests_hit():
    prompts = shared_prefix_prompts(8, 160, 10)
    requests, manager, scheduler = run(prompts, 4, num_pages=200, page_size=16, policy="radix",
                                       budget=64)
    assert all(r.output_token_ids == reference(p, 4) for r, p in zip(requests, prompts))
    assert sum(r.num_cached_tokens for r in requests) >= 7 * 160
    stats = manager.stats()
    assert stats.prefix_cache_hits >= 7 * 160


def test_pool_too_small_for_all_preempts_and_still_gives_the_reference():
    prompts = shared_prefix_prompts(6, 8, 8)
    requests, _, scheduler = run(prompts, 40, num_pages=16, page_size=8, policy="off", budget=64)
    assert scheduler.stats.num_preemptions > 0
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == reference(prompt, 40)


def test_swap_preemption_restores_pages_and_gives_the_reference():
    prompts = shared_prefix_prompts(6, 8, 8)
    requests, _, scheduler = run(prompts, 40, num_pages=16, page_size=8, policy="off", budget=64,
                                 preemption_mode="swap")
    assert scheduler.stats.num_preemptions > 0
    assert scheduler.manager.offload.host.stats.swap_ins > 0
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == reference(prompt, 40)


def test_swap_space_full_falls_back_to_recompute():
    prompts = shared_prefix_prompts(6, 8, 8)
    requests, _, scheduler = run(prompts, 40, num_pages=16, page_size=8, policy="off", budget=64,
                                 preemption_mode="swap", swap_pages=0)
    assert scheduler.stats.num_preemptions > 0 and scheduler.manager.offload.host.stats.swap_outs == 0
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == reference(prompt, 40)


@pytest.mark.parametrize("policy", ["off", "radix"])
def test_forked_samples_share_prompt_pages(policy):
    prompt = shared_prefix_prompts(1, 100, 3)[0]
    peak = {}
    for n in (1, 4):
        result = run([prompt], 5, num_pages=64, page_size=16, policy=policy, budget=512, n=n)
        assert len(result.requests) == n
        for request in result.requests:
            assert request.output_token_ids == reference(prompt, 5)
        peak[n] = result.peak_used_pages
    assert peak[1] == 7  # 103 prompt + 5 output tokens in pages of 16
    assert peak[4] <= peak[1] + 3  # the prompt's pages once, plus one copied last page per extra sample


def test_namespaces_never_share_pages():
    prompts = shared_prefix_prompts(2, 64, 0)
    prompts[1] = list(prompts[0])
    requests, _, _ = run(prompts, 4, num_pages=64, page_size=16, policy="radix", budget=512,
                         namespaces=["tenant-a", "tenant-b"])
    assert [r.num_cached_tokens for r in requests] == [0, 0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    policy=st.sampled_from(["off", "hash", "radix"]),
    preemption_mode=st.sampled_from(["recompute", "swap"]),
    n=st.integers(1, 3),
    budget=st.integers(8, 96),
    extra_pages=st.integers(0, 40),
    num_prompts=st.integers(1, 6),
    prefix_len=st.integers(0, 40),
    tail_len=st.integers(1, 20),
    max_tokens=st.integers(1, 12),
)
def test_outputs_equal_the_reference_whatever_the_cache_does(page_size, policy, preemption_mode, n,
                                                            budget, extra_pages, num_prompts,
                                                            prefix_len, tail_len, max_tokens):
    prompts = shared_prefix_prompts(num_prompts, prefix_len, tail_len)
    longest = max(len(p) for p in prompts) + max_tokens
    num_pages = 1 + n * (-(-longest // page_size) + 1) + extra_pages  # one request's n samples fit
    requests, _, _ = run(prompts, max_tokens, num_pages=num_pages, page_size=page_size,
                         policy=policy, budget=budget, preemption_mode=preemption_mode, n=n)
    for request in requests:
        assert request.output_token_ids == reference(request.prompt_token_ids, max_tokens)
