"""The scheduler with a shared tier, driven with no model (the fake runner of test_scheduler.py): two
instances share pages through a dict keyed by page hash, as they do through Redis. Loaded pages must
give the reference outputs, count as cached, and the tier is asked once per admission."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.cache.hashing import page_hashes
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.offload import Offloader
from kvserve.cache.tiers import HostTier
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from tests.test_scheduler import FakeRunner, finish_step, reference, shared_prefix_prompts


class DictRemote:
    """A shared tier in a dict: page hash -> the page's content (token ids, as FakeRunner stores)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[bytes, list[int]] = {}
        self.calls: list[tuple[tuple[int, ...], int, int]] = []  # (tokens, start_page, num_pages)
        self.asked: list[list[bytes]] = []  # the hashes of each call
        self.requests = lambda: []  # () -> the asking instance's requests, to name each call
        self.free_pages = None  # () -> the asking instance's free pages, to check the query's size

    def get_pages(self, hashes: list[bytes]) -> list[list[int]]:
        assert self.free_pages is None or len(hashes) <= self.free_pages()
        self.calls.append(self._describe(hashes))
        self.asked.append(list(hashes))
        found = []
        for h in hashes:
            if h not in self.pages:
                break
            found.append(list(self.pages[h]))
        return found

    def _describe(self, hashes: list[bytes]) -> tuple[tuple[int, ...], int, int]:
        for request in self.requests():
            tokens = request.token_ids
            chain = page_hashes(tokens, self.page_size, request.namespace)
            if hashes[0] in chain:
                start = chain.index(hashes[0])
                if chain[start:start + len(hashes)] == hashes:
                    return tuple(tokens), start, len(hashes)
        raise AssertionError("the tier was asked for pages of no request")

    def is_known(self, page_hash: bytes) -> bool:
        return page_hash in self.pages

    def available(self) -> bool:
        return True

    def put_many(self, items) -> int:
        for h, content in items:
            self.pages.setdefault(h, list(content))
        return len(items)

    offer = put_many

    def engine_stats(self) -> dict[str, int]:
        return {}


class Instance:
    """One engine's cache side: manager, scheduler and fake runner, publishing committed pages."""

    def __init__(self, remote: DictRemote, num_pages: int, policy: str = "radix", budget: int = 512,
                 max_num_seqs: int = 8, preemption_mode: str = "recompute") -> None:
        ps = remote.page_size
        self.remote = remote
        self.host = HostTier(capacity_bytes=64, page_bytes=1)
        self.manager = KVCacheManager(num_pages, ps, policy,
                                      offload=Offloader(ps, self.host, shared=remote, publish_sync=True))
        self.scheduler = Scheduler(self.manager, max_num_seqs, budget, max_model_len=10_000,
                                   preemption_mode=preemption_mode)
        self.runner = FakeRunner(num_pages, ps)

    def add(self, request: Request) -> None:
        self.remote.requests = lambda: list(self.scheduler.requests.values())
        self.scheduler.add(request)

    def run(self, prompts: list[list[int]], max_tokens: int, n: int = 1) -> list[Request]:
        requests = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            samples = [Request(f"r{i}#{k}", prompt, params) for k in range(n)]
            samples[0].fork_children = samples[1:]
            self.add(samples[0])
            requests.extend(samples)
        steps, calls_before = 0, len(self.remote.calls)
        self.remote.free_pages = lambda: self.manager.num_free_pages
        while self.scheduler.has_unfinished():
            num_calls = len(self.remote.calls)
            out = self.scheduler.schedule()
            assert out.seqs, "no progress"
            for hashes in self.remote.asked[num_calls:]:  # asked only when admitting
                assert any(_is_run_of(hashes, page_hashes(r.token_ids, self.remote.page_size,
                                                          r.namespace))
                           for r in self.scheduler.running)
            finish_step(self.scheduler, self.runner, out, now=float(steps))
            self.manager.check_invariants()
            steps += 1
            assert steps < 10_000
        assert self.manager.num_used_pages == 0
        admissions = sum(1 + r.num_preemptions for r in requests)
        assert len(self.remote.calls) - calls_before <= admissions  # never per waiting step
        self.remote.free_pages = None
        return requests


def _is_run_of(hashes: list[bytes], chain: list[bytes]) -> bool:
    return hashes[0] in chain and chain[chain.index(hashes[0]):][:len(hashes)] == hashes


def cacheable(num_tokens: int, page_size: int) -> int:
    return (num_tokens - 1) // page_size * page_size


def test_b_loads_the_pages_a_computed_and_gives_the_reference():
    remote = DictRemote(page_size=4)
    prompts = shared_prefix_prompts(3, 30, 9)
    Instance(remote, num_pages=64).run(prompts, 5)
    b = Instance(remote, num_pages=64)
    requests = b.run(prompts, 5)
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == reference(prompt, 5)
        assert request.num_cached_tokens == cacheable(len(prompt), 4)
    assert b.manager.prefix_cache_hits == sum(cacheable(len(p), 4) for p in prompts)
    # the first request loads all its pages; the others hit the shared prefix (7 pages) locally,
    # then ask for their own 2 pages
    assert [c[1:] for c in remote.calls[3:]] == [(0, 9), (7, 2), (7, 2)]


def test_a_partial_local_hit_is_cut_to_its_page_when_the_remote_has_more():
    remote = DictRemote(page_size=4)
    prompt = list(range(1, 40))
    Instance(remote, num_pages=64).run([prompt], 3)
    b = Instance(remote, num_pages=64)
    b.run([prompt[:10] + [999, 998, 997]], 2)  # B holds pages 0-1 and 2 tokens of page 2
    (request,) = b.run([prompt], 3)
    assert request.output_token_ids == reference(prompt, 3)
    assert request.num_cached_tokens == 36
    assert remote.calls[-1][1:] == (2, 7)  # asked from the partial page on


def test_under_page_pressure_the_remote_is_asked_only_when_admitting():
    """(Instance.run checks each query: followed by the admission, within the free pages.)"""
    remote = DictRemote(page_size=4)
    long_prompt = shared_prefix_prompts(1, 60, 0)[0]
    Instance(remote, num_pages=64).run([long_prompt], 1)
    num_a_calls = len(remote.calls)
    b = Instance(remote, num_pages=22, budget=8)  # 21 usable pages
    first = list(range(500, 576))  # 76 tokens + 8 generated: 21 pages at its end
    requests = b.run([first, long_prompt], 8)
    assert [r.output_token_ids for r in requests] == [reference(r.prompt_token_ids, 8)
                                                     for r in requests]
    asked = [c for c in remote.calls[num_a_calls:] if c[0] == tuple(long_prompt)]
    assert 1 <= len(asked) <= 1 + requests[1].num_preemptions
    assert requests[1].num_cached_tokens > 0


def test_a_request_waiting_for_a_seat_is_not_looked_up_remotely():
    remote = DictRemote(page_size=4)
    long_prompt = shared_prefix_prompts(1, 60, 0)[0]
    Instance(remote, num_pages=64).run([long_prompt], 1)
    b = Instance(remote, num_pages=64, max_num_seqs=1)
    b.run([list(range(500, 510)), long_prompt], 20)
    assert len([c for c in remote.calls if c[0] == tuple(long_prompt)]) == 2  # A's, then B's


def test_namespaces_stay_apart_in_the_remote():
    remote = DictRemote(page_size=4)
    prompt = list(range(1, 30))
    a = Instance(remote, num_pages=64)
    request = Request("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True), cache_salt="t1")
    a.add(request)
    while a.scheduler.has_unfinished():
        finish_step(a.scheduler, a.runner, a.scheduler.schedule(), now=0.0)
    (other,) = Instance(remote, num_pages=64).run([prompt], 2)  # namespace ""
    assert other.num_cached_tokens == 0


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_forks_and_chunked_prefill_on_loaded_pages(policy):
    remote = DictRemote(page_size=4)
    prompts = shared_prefix_prompts(2, 41, 6)
    Instance(remote, num_pages=128, policy=policy).run(prompts, 4, n=3)
    b = Instance(remote, num_pages=128, policy=policy, budget=6)
    for request in b.run(prompts, 4, n=3):
        assert request.output_token_ids == reference(request.prompt_token_ids, 4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    policy=st.sampled_from(["hash", "radix"]),
    preemption_mode=st.sampled_from(["recompute", "swap"]),
    n=st.integers(1, 3),
    budget=st.integers(4, 96),
    extra_pages=st.integers(0, 40),
    num_prompts=st.integers(1, 6),
    prefix_len=st.integers(0, 40),
    tail_len=st.integers(1, 20),
    max_tokens=st.integers(1, 12),
    a_share=st.integers(0, 6),
)
def test_outputs_equal_the_reference_whatever_the_remote_holds(
        page_size, policy, preemption_mode, n, budget, extra_pages, num_prompts, prefix_len,
        tail_len, max_tokens, a_share):
    prompts = shared_prefix_prompts(num_prompts, prefix_len, tail_len)
    longest = max(len(p) for p in prompts) + max_tokens
    num_pages = 1 + n * (-(-longest // page_size) + 1) + extra_pages
    remote = DictRemote(page_size)
    Instance(remote, num_pages=num_pages, policy=policy, budget=budget).run(prompts[:a_share], 2)
    b = Instance(remote, num_pages=num_pages, policy=policy, budget=budget,
                 preemption_mode=preemption_mode)
    for request in b.run(prompts, max_tokens, n=n):
        assert request.output_token_ids == reference(request.prompt_token_ids, max_tokens)
