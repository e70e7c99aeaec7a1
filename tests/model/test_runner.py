"""ModelRunner, driven directly with hand-built SchedulerOutputs, produces transformers' greedy
tokens (float32) one prompt at a time and batched with chunked prefill, for several page sizes; and
its page operations move exactly the pages they name."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvserve.config import KV_DTYPES
from kvserve.model.gguf_loader import bundled_model_path, load_gguf
from kvserve.model.runner import ModelRunner
from kvserve.batch import PageOps, ScheduledSeq, SchedulerOutput, StepResult
from tests.conftest import ALONE_IN_THE_RUNNER_TEST, varied_prompts

NEW_TOKENS = 44  # as tests/test_engine.py (transformers' reference is memoized for both)
CHUNK = 256
BUDGET = 512  # tokens per step: decodes first, then prefill chunks of at most CHUNK


@dataclass
class Seq:
    """A request as this test's toy scheduler sees it."""

    tokens: list[int]
    prompt_len: int
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


def generate(runner: ModelRunner, prompts: list[list[int]], batched: bool, seed: int = 0) -> list[list[int]]:
    """Greedy NEW_TOKENS for each prompt. Pages come from a shuffled free list of 1..N (page 0 is
    the null page); a request gets pages as its positions need them."""
    free = list(range(1, runner.num_pages))
    random.Random(seed).shuffle(free)
    seqs = [Seq(list(p), len(p)) for p in prompts]
    while any(s.num_generated < NEW_TOKENS for s in seqs):
        active = [s for s in seqs if s.num_generated < NEW_TOKENS]
        active = active if batched else active[:1]
        decodes = [s for s in active if s.num_computed == len(s.tokens) - 1]
        budget = BUDGET - len(decodes)
        scheduled = []
        for s in active:  # in request order, so decode rows and prefill rows interleave
            n = 1 if s in decodes else min(CHUNK, len(s.tokens) - s.num_computed, budget)
            if s not in decodes:
                if n <= 0:
                    continue
                budget -= n
            end = s.num_computed + n
            while len(s.block_table) * runner.page_size < end:
                s.block_table.append(free.pop())
            scheduled.append((s, ScheduledSeq(
                "r", s.tokens[s.num_computed:end], s.num_computed, list(s.block_table),
                need_sample=end == len(s.tokens),
            )))
        results = runner.execute(SchedulerOutput([sch for _, sch in scheduled])).sampled
        for (s, sch), sampled in zip(scheduled, results):
            s.num_computed += len(sch.token_ids)
            assert (sampled is not None) == sch.need_sample
            if sampled is not None:
                s.tokens.append(sampled.token_id)
    return [s.tokens[s.prompt_len:] for s in seqs]


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(bundled_model_path())


@pytest.fixture(scope="module")
def prompts(loaded):
    """Four of tests/test_engine.py's prompts (so transformers' reference is made once a session),
    one per length class: short text, chat markup, repeated prose, a ~1,500-token document."""
    out = [varied_prompts(loaded.tokenizer)[i] for i in ALONE_IN_THE_RUNNER_TEST]
    assert len(out[0]) <= 8 and 30 <= len(out[1]) <= 60 and 150 <= len(out[2]) <= 400
    assert 1400 <= len(out[3]) <= 1700, len(out[3])
    return out


@pytest.fixture(scope="module")
def expected(prompts, hf_reference):
    return [hf_reference(p, NEW_TOKENS) for p in prompts]


def make_runner(loaded, page_size: int, num_tokens: int = 2400) -> ModelRunner:
    return ModelRunner(loaded, 1 + -(-num_tokens // page_size) + 4, page_size, KV_DTYPES["fp32"])


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16])  # engine tests cover 1 and 128
def test_batched_chunked_greedy_equals_transformers(loaded, prompts, expected, page_size):
    got = generate(make_runner(loaded, page_size), prompts, batched=True, seed=page_size)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) diverges at {next(j for j, (a, b) in enumerate(zip(g, e)) if a != b)}"


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16])  # engine tests cover 1 and 128
def test_one_at_a_time_greedy_equals_transformers(loaded, prompts, expected, page_size):
    # every prompt runs batched for every page size; alone, all of them only with pages of 16
    which = range(len(prompts)) if page_size == 16 else range(2)
    got = generate(make_runner(loaded, page_size), [prompts[i] for i in which], batched=False)
    assert got == [expected[i] for i in which]


# -- page operations ------------------------------------------------------------------------------

def small_runner(loaded) -> ModelRunner:
    runner = ModelRunner(loaded, 6, 4, KV_DTYPES["fp32"])
    runner.kv.copy_(torch.randn(runner.kv.shape))
    return runner


def test_copy_pages_copies_every_layer_k_and_v(loaded):
    runner = small_runner(loaded)
    before = runner.kv.clone()
    runner.copy_pages([(1, 4), (2, 5)])
    assert torch.equal(runner.kv[:, :, 4], before[:, :, 1]) and torch.equal(runner.kv[:, :, 5], before[:, :, 2])
    assert torch.equal(runner.kv[:, :, :4], before[:, :, :4])


def test_read_write_pages_round_trip(loaded):
    runner = small_runner(loaded)
    data = runner.read_pages([3, 1])
    assert data.shape == (2, runner.page_bytes) and runner.page_bytes == 2 * 30 * 4 * 3 * 64 * 4
    as_floats = data.view(torch.float32).view(2, 30, 2, 4, 3, 64)
    assert torch.equal(as_floats[0, 7, 1], runner.kv_caches[7][1].data[3])  # layer 7, V, page 3
    runner.write_pages([5, 2], data)
    assert torch.equal(runner.kv[:, :, 5], runner.kv[:, :, 3]) and torch.equal(runner.kv[:, :, 2], runner.kv[:, :, 1])


def test_kv_cache_bytes(loaded):
    assert small_runner(loaded).kv_cache_bytes() == 6 * 2 * 30 * 4 * 3 * 64 * 4
    fp16 = ModelRunner(loaded, 6, 4, KV_DTYPES["fp16"])
    assert fp16.kv_cache_bytes() == 6 * 2 * 30 * 4 * 3 * 64 * 2


def test_page_copies_apply_before_compute(loaded):
    """A step whose only work is a page copy still copies; a step with sequences sees the copy."""
    runner = small_runner(loaded)
    before = runner.kv.clone()
    assert runner.execute(SchedulerOutput([], PageOps(copies=[(1, 2)]))) == StepResult()
    assert torch.equal(runner.kv[:, :, 2], before[:, :, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shorter_rope_table_is_the_same_bits_as_a_longer_ones_rows(dtype):
    """build_model shares one model between nearby max_model_len (rope_positions' buckets): sound only
    while row p of a RoPE table does not depend on the table's length."""
    from kvserve.model.llama import Rotary

    factors = tuple(1.0 + 0.37 * i for i in range(32))  # llama3-style frequency factors
    long = Rotary(64, 500000.0, 8192, torch.device("cpu"), dtype, factors)
    for n in (1, 17, 100, 2047, 4097):
        short = Rotary(64, 500000.0, n, torch.device("cpu"), dtype, factors)
        for a, b in ((short.cos, long.cos[:n]), (short.sin, long.sin[:n])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bits: -0.0 is not 0.0


def test_rope_positions_round_up_to_a_bucket_within_the_context():
    from kvserve.model.runner import ROPE_MIN_POSITIONS, rope_positions

    assert rope_positions(56, 8192) == rope_positions(2048, 8192) == 8192
    assert rope_positions(100, 512) == 512  # never past the model's context
    assert rope_positions(ROPE_MIN_POSITIONS + 1, 131072) == 2 * ROPE_MIN_POSITIONS
    assert rope_positions(131072, 131072) == 131072


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_half_width_rope_tables_give_the_full_width_tables_rows_bit_for_bit(dtype):
    """Rotary keeps one column an angle and widens the rows it looks up: the same bits as the full-width
    tables (cos twice, sin with its first half negated) rounded to the compute dtype, at half the memory."""
    from kvserve.model.llama import Rotary

    rotary = Rotary(64, 10000.0, 4096, torch.device("cpu"), dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    full_cos, full_sin = angles.cos().repeat(1, 2).to(dtype), torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    positions = torch.tensor([0, 1, 7, 1000, 4095, 7])
    cos, sin = rotary(positions)
    assert cos.shape == sin.shape == (6, 1, 64) and rotary.cos.shape == rotary.sin.shape == (4096, 32)
    for got, want in ((cos[:, 0], full_cos[positions]), (sin[:, 0], full_sin[positions])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bits: -0.0 is not 0.0
