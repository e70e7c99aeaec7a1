"""Shared test factories: engines that are checked for leaked pages after every test, and the
transformers reference on the same GGUF weights."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
WORKLOADS = Path(os.environ.get("KVSERVE_WORKLOADS", SHARED / "workloads"))

_engines: list = []



def default_mode_is_invariant() -> bool:
    """Whether `--dtype auto` resolves to kvserve's native kernels here, which are invariant by
    construction (DESIGN.md §8). Without them (KVSERVE_KERNELS=off, no build) it is torch's packed
    int4, whose long chunks run a dense bf16 matmul and short ones the int4 kernel: not invariant."""
    from kvserve.config import resolve_model_dtype

    return resolve_model_dtype("auto", "cpu") == "native"


# the default mode, in the tests that hold it to cache-on/off identity
DEFAULT_MODE = pytest.param("auto", id="auto", marks=pytest.mark.skipif(
    not default_mode_is_invariant(), reason="--dtype auto is torch's int4 here (kernels off or not "
    "built), which is not invariant by construction"))
# Weight modes every cache-on/off identity test runs in (DESIGN.md §1.4: a cache feature never changes
# a greedy answer, in the exact path and in the default mode users run).
IDENTITY_MODES = ["float32", DEFAULT_MODE]
# The weight mode of tests that hold a property (the API's behaviour, isolation, a cache feature's
# identity) rather than transformers' tokens: the default mode users run where it is invariant (its
# decode reads a fifth of float32's bytes a token), float32 where it is not.
PROPERTY_MODE = "auto" if default_mode_is_invariant() else "float32"


def make_llm(**kwargs):
    """An LLM whose pool is checked to be empty (no page in use) when the test ends. dtype is
    float32 unless a test asks for another: the engine tests compare with transformers token by token."""
    from kvserve import LLM

    kwargs.setdefault("dtype", "float32")
    llm = LLM(**kwargs)
    _engines.append(llm)
    return llm


def pool_memory(num_pages: int, page_size: int = 16, kv_cache_dtype: str = "auto", dtype: str = "float32") -> int:
    """The kv_cache_memory that gives exactly `num_pages` pages (page 0 included) to the bundled model."""
    from kvserve.config import kv_bytes_per_page, resolve_kv_dtype, resolve_model_dtype
    from kvserve.model.gguf_loader import bundled_model_path, load_gguf

    model = load_gguf(bundled_model_path()).config
    return num_pages * kv_bytes_per_page(model.num_layers, model.num_kv_heads, model.head_dim,
                                         page_size, resolve_kv_dtype(kv_cache_dtype, resolve_model_dtype(dtype, "cpu")))


def pooled_llm(num_pages: int, **kwargs):
    """make_llm with a pool of exactly `num_pages` pages of its page size, in PROPERTY_MODE unless `dtype`
    is given."""
    kwargs.setdefault("dtype", PROPERTY_MODE)
    kwargs["kv_cache_memory"] = pool_memory(num_pages, kwargs.get("page_size", 16), dtype=kwargs["dtype"])
    return make_llm(**kwargs)


def _handbook() -> str:
    with open(WORKLOADS / "w1.jsonl") as f:
        return json.loads(f.readline())["prompt"]


def varied_prompts(tokenizer) -> list[list[int]]:
    """Ten prompts from 5 to ~1,500 tokens: prose, code, unicode, numbers, chat markup."""
    handbook = _handbook()
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "Translate to French: The weather is lovely today, and the café on the corner — "
        "the one with the blue door — has reopened. Über alles: naïve façade, 東京, emoji 🚢.",
        "1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181, 6765,",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "Give me three tips for writing clear commit messages.<|im_end|>\n<|im_start|>assistant\n",
        handbook[:1200] + "\n\nUser: How do I report a data breach?\nAssistant:",
        "Once upon a time, in a harbour town where the fog never lifted, " * 12,
        handbook[:3000] + "\n\nSummary of the rules above:",
        handbook[2000:6000] + "\n\nQuestion: what happens if a delivery is late?\nAnswer:",
        handbook + "\n\nUser: Who approves overtime?\nAssistant:",
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] <= 8 and lengths[-1] >= 1400, lengths
    return prompts


# the varied prompts that tests/model/test_runner.py runs alone (one per length class: <= 8, 30-60,
# 150-400 and ~1,500 tokens); tests/test_engine.py runs the other six alone
ALONE_IN_THE_RUNNER_TEST = (0, 4, 6, 9)


@pytest.fixture(autouse=True)
def no_leaked_pages():
    yield
    engines = list(_engines)
    _engines.clear()
    for llm in engines:
        manager = llm.engine.manager
        assert not llm.engine.has_unfinished(), "a request was left unfinished"
        assert manager.num_used_pages == 0, f"{manager.num_used_pages} pages leaked"
        manager.check_invariants()
        draft_kv = llm.engine.scheduler.spec.draft_kv if llm.engine.scheduler.spec else None
        if draft_kv is not None:  # the draft model's own pages (speculative method draft_model)
            assert draft_kv.num_used == 0, f"{draft_kv.num_used} draft-model pages leaked"
            draft_kv.check_invariants()


@contextlib.contextmanager
def gguf_parsed_once(readers: dict):
    """Inside: gguf-py's GGUFReader made once per file, kept in `readers`. transformers parses every field
    of a GGUF at each load from it (its config, then its weights, then its tokenizer: three parses of one
    file; Gemma-3's 262k-token vocabulary takes ~14 s a parse and ~680 MB while `readers` holds it)."""
    import gguf

    original = gguf.GGUFReader

    def shared(path, mode="r"):
        key = (os.path.realpath(path), mode, os.stat(path).st_mtime_ns)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


@pytest.fixture(scope="session")
def bundled_gguf_readers() -> dict:
    """The bundled file's gguf-py parse, shared by the session's transformers model and tokenizer."""
    return {}


@pytest.fixture(scope="session")
def hf_model(bundled_gguf_readers):
    """transformers (float32) loading the same GGUF file as the engine."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvserve.model.gguf_loader import bundled_model_path

    path = Path(bundled_model_path())
    with gguf_parsed_once(bundled_gguf_readers):
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_gguf_readers):
    """transformers' tokenizer of the bundled GGUF (built from its vocabulary in Python: seconds, once)."""
    from transformers import AutoTokenizer

    from kvserve.model.gguf_loader import bundled_model_path

    path = Path(bundled_model_path())
    with gguf_parsed_once(bundled_gguf_readers):
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_reference(hf_model):
    """Greedy continuation by transformers, token by token (a manual loop: no EOS handling).

    Memoized per prompt for the session (the engine and runner tests share prompts): the loop's
    first n steps are the same computation whatever the total, so a shorter request is served from
    the prefix of a longer continuation already made."""
    import torch

    model = hf_model
    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = tuple(prompt_ids)
        if len(memo.get(key, ())) < max_new_tokens:
            out: list[int] = []
            with torch.inference_mode():
                ids = torch.tensor([prompt_ids])
                past = None
                for _ in range(max_new_tokens):
                    result = model(input_ids=ids, past_key_values=past, use_cache=True)
                    past = result.past_key_values
                    token = int(result.logits[0, -1].argmax())
                    out.append(token)
                    ids = torch.tensor([[token]])
            memo[key] = out
        return memo[key][:max_new_tokens]

    return greedy
