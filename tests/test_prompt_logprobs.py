"""Prompt logprobs (vLLM's `prompt_logprobs`; what `echo` with `logprobs` scores with): at float32 each prompt
token's logprob equals transformers' log-softmax there, whatever the prefill chunking, with the prompt's pages
in the prefix cache already, and for every sample of n; the rank counts the tokens more likely."""

from __future__ import annotations

import pytest

from kvserve.sampling_params import SamplingParams
from tests.conftest import default_mode_is_invariant, make_llm

PROMPT = ("The lighthouse keeper wrote every ship into her logbook, fed the gulls at dawn and watched the fog "
          "lift over the rocks before the supply boat came in from the mainland.")


def assert_same(got: list, expected: list) -> None:
    """The same bits on kvserve's native kernels, invariant to the batch by construction; without them
    (KVSERVE_KERNELS=off) torch's matmul rounds by the rows it gets: the same tokens and top tokens, logprobs
    equal to float32 rounding, and ranks that a near-tie may move by one."""
    if default_mode_is_invariant():
        assert got == expected
        return
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.token_id, list(a.top)) == (b.token_id, list(b.top)) and abs(a.rank - b.rank) <= 1
            assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-5)
            assert list(a.top.values()) == pytest.approx(list(b.top.values()), rel=1e-5, abs=1e-5)


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer):
    """transformers' log-softmax at each prompt position, for the bundled tokenizer's ids of PROMPT."""
    import torch

    from kvserve.model.gguf_loader import bundled_model_path, load_gguf

    ids = load_gguf(bundled_model_path()).tokenizer.encode(PROMPT, add_special_tokens=False).ids
    with torch.inference_mode():
        logp = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, logp


@pytest.mark.parametrize("chunk", [16, 2048])
def test_prompt_logprobs_equal_transformers_and_ignore_the_prefix_cache(reference, chunk):
    ids, logp = reference
    llm = make_llm(max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2))  # its pages now in the cache
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row, token = logp[position - 1], ids[position]
        assert entry.token_id == token and entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1 or abs(row[token] - row.sort(descending=True)
                                                                      .values[entry.rank - 1]) < 1e-4
        assert list(entry.top) == row.topk(3).indices.tolist()
    # n samples share the prompt: the same prompt logprobs on their output; none when not asked
    sampled = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, n=3, temperature=1.0, seed=1,
                                                                       prompt_logprobs=3))[0]
    assert_same(sampled.prompt_logprobs, out.prompt_logprobs)
    assert llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


def test_preemption_leaves_prompt_logprobs_as_they_were():
    """A pool too small for all of them at once: requests preempted (recomputed) mid-prompt or mid-output
    give the prompt logprobs they give alone."""
    from tests.conftest import PROPERTY_MODE, pool_memory

    prompts = [{"prompt_token_ids": [1 + (i * 37 + j * 11) % 4000 for j in range(40 + 7 * i)]} for i in range(8)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    alone = [o.prompt_logprobs for o in make_llm(dtype=PROPERTY_MODE).generate(prompts, params)]
    small = make_llm(dtype=PROPERTY_MODE, kv_cache_memory=pool_memory(14, dtype=PROPERTY_MODE), max_model_len=128,
                     max_num_batched_tokens=32)
    for got, expected in zip([o.prompt_logprobs for o in small.generate(prompts, params)], alone, strict=True):
        assert_same(got, expected)
    assert small.stats()["num_preemptions"] > 0
