"""A GGUF holding a format the native kernels lack (IQ4_XS) runs under the default --dtype auto: its
tensors are requantized to Q8_0 at load, the others keep their own format, and the load says so once."""

from __future__ import annotations

import logging
import zlib

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve import kernels
from kvserve.sampling_params import SamplingParams
from tests.conftest import make_llm
from tests.model.tiny_models import make_hf_model, write_gguf

IQ4_XS = GGMLQuantizationType.IQ4_XS
SEED = 1  # of seeds 0-3 the one whose free-running greedy tokens diverge, and 0.079 at most
pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are not built here")


def random_iq4_xs(name: str, w: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType] | None:
    """Random IQ4_XS blocks (d, 6-bit scales, 4-bit codes) for the layers' matrices, F32 elsewhere;
    d is drawn so that the weights have a real model's magnitude (std ~0.03)."""
    block, block_bytes = GGML_QUANT_SIZES[IQ4_XS]
    if w.ndim != 2 or w.shape[1] % block or not name.startswith("blk."):
        return None
    rng = np.random.default_rng(zlib.crc32(name.encode()) + SEED)  # (hash() differs per process)
    blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, block_bytes), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(2e-5, 4e-5, blocks.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(w.shape[0], -1), IQ4_XS


@pytest.fixture(scope="module")
def iq4_xs_model(tmp_path_factory) -> str:
    model = make_hf_model("llama3", hidden_size=256, intermediate_size=512, head_dim=64)
    return str(write_gguf(model, "llama3", tmp_path_factory.mktemp("iq4") / "iq4_xs.gguf",
                          store=random_iq4_xs))


def greedy(llm, prompt: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    return list(out.token_ids), [lp[token] for token, lp in zip(out.token_ids, out.logprobs)]


def next_logprobs(llm, ids: list[int]) -> dict[int, float]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    return llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].logprobs[0]


def test_auto_runs_an_iq4_xs_file_and_says_so_once(iq4_xs_model, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.model"):
        llm = make_llm(model=iq4_xs_model, dtype="auto", kv_cache_memory="16MiB", kv_cache_dtype="fp32")
    assert llm.engine.config.dtype == "native"
    notes = [r.getMessage() for r in caplog.records if "IQ4_XS" in r.getMessage()]
    assert len(notes) == 1 and "requantized to Q8_0" in notes[0], notes
    prompt = [5, 17, 300, 1200, 42, 7]
    exact_tokens, exact_logprobs = greedy(make_llm(model=iq4_xs_model, dtype="float32", kv_cache_memory="16MiB"),
                                          prompt)
    # along float32's greedy path (a random model's near-ties may flip a free-running greedy token), each
    # next token's logprob is within 0.15 of float32's: Q8_0's rounding of the IQ4_XS values (fp32 KV in
    # both, so that is the whole difference; 0.031-0.079 at most over seeds 0-3 when this was written)
    for i, (token, exact) in enumerate(zip(exact_tokens, exact_logprobs)):
        logprobs = next_logprobs(llm, prompt + exact_tokens[:i])
        assert token in logprobs and abs(logprobs[token] - exact) < 0.15, (i, logprobs, token, exact)
