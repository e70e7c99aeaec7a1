"""Llama 3 (llama3 RoPE scaling), Qwen2, Qwen3 and Gemma 3 (sliding window of 8): tiny random-weight
models give transformers' greedy tokens (float32) when loaded from GGUF and from a safetensors folder;
and the architecture tables read configs and stop ids as llama.cpp and transformers define them."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import ConfigError
from kvserve.model import architectures
from kvserve.model.gguf_loader import load_gguf, resolve_model_path
from tests.conftest import gguf_parsed_once, make_llm
from tests.model.tiny_models import VOCAB, make_hf_model, save_folder, write_gguf

KINDS = ["llama3", "qwen2", "qwen3", "gemma3"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (transformers model, GGUF path, folder path), built once per module."""
    built = {}

    def get(kind: str):
        if kind not in built:
            model = make_hf_model(kind)
            root = tmp_path_factory.mktemp(kind)
            gguf_path = None if kind == "gemma3-scaled" else str(write_gguf(model, kind, root / f"{kind}.gguf"))
            built[kind] = (model, gguf_path, str(save_folder(model, root / "hf")))
        return built[kind]

    return get


def prompts(seed: int = 0) -> list[list[int]]:
    """Prompts longer than Gemma's window of 8, and one shorter."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 23, 41)]


def reference(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def kvserve_tokens(path: str, batch: list[list[int]], page_size: int) -> list[list[int]]:
    llm = make_llm(model=path, dtype="float32", page_size=page_size, kv_cache_memory="32MiB",
                   max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_greedy_tokens_equal_transformers(tiny, kind, source):
    model, gguf_path, folder = tiny(kind)
    if kind == "gemma3" and source == "folder":  # also a query_pre_attn_scalar other than head_dim
        model, _, folder = tiny("gemma3-scaled")
        assert load_gguf(folder).config.attention_scale == 40 ** -0.5
    batch = prompts()
    expected = [reference(model, p) for p in batch]
    path = gguf_path if source == "gguf" else folder
    # batched with chunked prefill (32-token budget) on pages of 4; from GGUF also one request on pages of 1
    assert kvserve_tokens(path, batch, page_size=4) == expected
    if source == "gguf":
        assert kvserve_tokens(path, batch[2:], page_size=1) == expected[2:]


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_and_folder_load_the_same_model(tiny, kind):
    _, gguf_path, folder = tiny(kind)
    a, b = load_gguf(gguf_path), load_gguf(folder)
    approx = {"rms_norm_eps", "rope_freq_factors"}  # GGUF stores them as float32
    exact = set(a.config.__slots__) - approx - {"name"}
    assert {f: getattr(a.config, f) for f in exact} == {f: getattr(b.config, f) for f in exact}
    assert a.config.rms_norm_eps == pytest.approx(b.config.rms_norm_eps)
    assert (a.config.rope_freq_factors is None) == (b.config.rope_freq_factors is None)
    if a.config.rope_freq_factors is not None:
        assert a.config.rope_freq_factors == pytest.approx(b.config.rope_freq_factors)
    assert a.weights.keys() == b.weights.keys()
    for name in a.weights:
        torch.testing.assert_close(a.weights[name], b.weights[name], rtol=0, atol=1e-6)


def test_gemma3_config_interleaves_five_sliding_layers_and_one_global(tiny):
    cfg = load_gguf(tiny("gemma3")[1]).config
    assert [cfg.layer_window(i) for i in range(6)] == [8, 8, 8, 8, 8, None]
    assert cfg.rope_local_theta == 10_000.0 and cfg.rope_theta == 1_000_000.0
    assert cfg.embedding_scale == 8.0 and cfg.attention_scale == 16 ** -0.5
    assert cfg.qk_norm and cfg.post_norms and cfg.hidden_act == "gelu_tanh"


def test_llama3_rope_factors_come_from_the_rope_freqs_tensor(tiny):
    cfg = load_gguf(tiny("llama3")[1]).config
    factors = cfg.rope_freq_factors
    assert factors is not None and factors[0] == 1.0 and factors[-1] == 8.0
    assert any(1.0 < f < 8.0 for f in factors)  # the smoothed band


def test_stop_ids_include_end_of_turn_control_tokens():
    tokens = ["<pad>", "<eos>", "<bos>", "hi", "<end_of_turn>", "<|eot_id|>"]
    types = [3, 3, 3, 1, 3, 3]
    assert architectures.stop_token_ids("gemma3", [1, None], tokens, types) == (1, 4)
    assert architectures.stop_token_ids("llama", [1], tokens, types) == (1, 5)
    types[4] = 1  # plain text spelled like the marker is not a stop id
    assert architectures.stop_token_ids("gemma3", [1], tokens, types) == (1,)


def test_unknown_architecture_and_missing_model_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not supported"):
        architectures.config_from_hf({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="model not found"):
        resolve_model_path(str(tmp_path))  # a folder without config.json


# --- the real Gemma-3-270m (Q4_K / Q5_0 / Q6_K / Q8_0, window 512) --------------------------------

@pytest.fixture(scope="module")
def gemma():
    from tests.model.gemma_weights import gemma_gguf

    return gemma_gguf()


@pytest.fixture(scope="module")
def gemma_readers() -> dict:
    """The Gemma file's gguf-py parse, shared by transformers' tokenizer and model here (dropped after)."""
    return {}


@pytest.mark.slow
def test_gemma_sentencepiece_tokenizer_equals_transformers(gemma, gemma_readers):
    from pathlib import Path

    from transformers import AutoTokenizer

    loaded = load_gguf(gemma)
    with gguf_parsed_once(gemma_readers):
        ref = AutoTokenizer.from_pretrained(str(Path(gemma).parent), gguf_file=Path(gemma).name)
    texts = ["Hello world!", "  two  spaces   and\ttabs\n\n\nend", "naïve café 東京 🤖", "x" * 40,
             "<start_of_turn>user\nHi<end_of_turn>\n", "def f(x):\n    return x**2  # square",
             "1234567 3.14159 -42", "[multimodal] <unused3> \u200b"]
    for text in texts:
        ids = loaded.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert loaded.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert ids[0] == 2  # add_bos
    assert loaded.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>


def gemma_prompt(loaded, num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = ("the river of time carries small stones and old songs toward a quiet sea where lanterns "
             "drift past harbours full of ships and tired sailors counting stars").split()
    text = " ".join(rng.choice(words) for _ in range(num_tokens))
    return loaded.encode(text)[:num_tokens]


@pytest.mark.slow
def test_gemma_greedy_equals_transformers_past_the_sliding_window(gemma, gemma_readers):
    """1,500 tokens (about three windows of 512) and a short prompt: batched on pages of 16 with the
    radix prefix cache (run twice: the second run reuses the cached pages), and one at a time on
    pages of 1 without it."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    loaded = load_gguf(gemma)
    assert loaded.config.sliding_window == 512
    batch = [gemma_prompt(loaded, n, seed) for n, seed in ((1500, 1), (40, 2))]
    with gguf_parsed_once(gemma_readers):
        ref = AutoModelForCausalLM.from_pretrained(str(Path(gemma).parent), gguf_file=Path(gemma).name,
                                                   dtype=torch.float32).eval()
    expected = []
    for p in batch:
        out = ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=[],
                           pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    del ref
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = make_llm(model=gemma, dtype="float32", page_size=16, prefix_cache="radix",
                   kv_cache_memory="256MiB", max_model_len=2048, max_num_batched_tokens=512)
    for run in range(2):
        outputs = llm.generate(batch, params)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected, run
    assert outputs[0].num_cached_tokens >= 1488  # the second run hit the cache
    llm = make_llm(model=gemma, dtype="float32", page_size=1, prefix_cache="off",
                   kv_cache_memory="128MiB", max_model_len=2048, max_num_batched_tokens=512)
    assert list(llm.generate(batch[:1], params)[0].outputs[0].token_ids) == expected[0]


@pytest.mark.slow
def test_smollm2_from_a_safetensors_folder_equals_the_gguf(tmp_path, hf_model, hf_tokenizer):
    import copy
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from kvserve.model.gguf_loader import bundled_model_path

    gguf_path = Path(bundled_model_path())
    # transformers will not save a model it loaded from GGUF (hf_model: the session's, loaded from
    # the bundled file): the same weights in a plain model will do
    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.bin"))

    text = "<|im_start|>user\nWhat is the capital of France? Answer briefly.<|im_end|>\n<|im_start|>assistant\n"
    from_gguf, from_folder = load_gguf(str(gguf_path)), load_gguf(str(tmp_path))
    assert from_folder.encode(text) == from_gguf.encode(text)
    assert from_folder.config.num_layers == from_gguf.config.num_layers
    assert set(from_gguf.eos_token_ids) <= set(from_folder.eos_token_ids)
    batch = [from_gguf.encode(text), from_gguf.encode("The history of the Roman Empire")]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = {}
    for source in (str(gguf_path), str(tmp_path)):
        llm = make_llm(model=source, dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
        outputs[source] = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]
    assert outputs[str(tmp_path)] == outputs[str(gguf_path)]


def test_incomplete_or_unsupported_folders_are_one_line_config_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        load_gguf(str(tmp_path))
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "gpt2", "hidden_size": 8}')
    (other / "model.safetensors").write_bytes(b"")
    (other / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="'gpt2' is not supported"):
        load_gguf(str(other))
    from tests.model.tiny_models import hf_config

    (other / "config.json").write_text(hf_config("qwen3").to_json_string())
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        load_gguf(str(other))
    (other / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ConfigError, match="missing or bad field 'hidden_size'"):
        load_gguf(str(other))


def test_transformers4_config_json_fields_are_read():
    """Real checkpoints carry transformers 4 fields: rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern instead of rope_parameters and layer_types."""
    gemma = architectures.config_from_hf({
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 1024,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert [gemma.layer_window(i) for i in range(12)] == [1024] * 5 + [None] + [1024] * 5 + [None]
    assert gemma.rope_theta == 1e6 and gemma.rope_local_theta == 1e4 and gemma.tie_word_embeddings
    assert gemma.rope_freq_factors == (8.0,) * 128
    llama = architectures.config_from_hf({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert llama.head_dim == 128 and llama.rope_theta == 5e5 and llama.sliding_window is None
    factors = llama.rope_freq_factors
    assert len(factors) == 64 and factors[0] == 1.0 and factors[-1] == 8.0
    assert all(a <= b for a, b in zip(factors, factors[1:]))  # longer wavelengths are stretched more


@pytest.mark.slow
def test_gemma_2048_token_request_holds_what_kvserve_plan_says(gemma, capsys):
    """Hybrid allocator: the 15 sliding layers hold the last 512 tokens' pages, the 3 global ones all
    2,048 (four windows), i.e. (5/6 x 512 + 1/6 x 2,048) tokens per layer on average; stats and plan
    agree."""
    import json

    from kvserve.tools.planner import main_plan
    from tests.tools.test_planner import plan_args

    llm = make_llm(model=gemma, page_size=16, kv_cache_memory="512MiB", max_model_len=8192,
                   max_num_batched_tokens=1024)
    engine = llm.engine
    prompt = gemma_prompt(engine.loaded, 2048, seed=3)
    assert len(prompt) == 2048
    engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()  # two chunks of 1,024: the prompt is computed and the first token sampled
    stats = engine.stats().as_dict()
    kv_dtype = engine.cache_config.kv_dtype.name
    assert main_plan(plan_args("--model", gemma, "--context", "2048", "--kv-cache-dtype", kv_dtype,
                               "--json")) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["hybrid_kv"] and plan["model"]["num_window_layers"] == 15
    assert stats["kv_bytes_used"] == plan["dtypes"][0]["request_bytes"]
    assert stats["num_pages_used"] == 2048 // 16 and stats["window_pool"]["num_pages_used"] == 512 // 16
    per_layer_token = plan["dtypes"][0]["bytes_per_token"] / 18
    assert stats["kv_bytes_used"] == per_layer_token * (15 * 512 + 3 * 2048)
    while engine.has_unfinished():
        engine.step()
