"""llama-server's `POST /infill` (llama.vim's and llama.vscode's code completion): the prompt's layout and
trimming, the same prompt length as the real llama-server on the same FIM model (a tiny synthetic model
whose tokenizer has FIM tokens), /completion's answer shape, and a clear 400 on a model without FIM tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import AddedToken

from kvserve.model.gguf_loader import load_gguf
from kvserve.model.known_models import bundled_model_path
from kvserve.server.fim import fim_tokens, text_only
from kvserve.server.infill import SNIPPET, InfillParts, infill_ids
from kvserve.tools.bench.servers import llama_server_path

FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
BODY = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "ret",
        "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"},
                        {"filename": "main.py", "text": "import util\n"}],
        "n_predict": 4, "temperature": 0}


@pytest.fixture(scope="module")
def fim_tokenizer():
    """The bundled tokenizer with FIM tokens added (it has <reponame>, not <|file_sep|>)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(load_gguf(bundled_model_path()).tokenizer.to_str())  # a copy: the load is shared
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    return tokenizer


def test_the_layout_is_llama_servers(fim_tokenizer):
    tok = fim_tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    pre, suf, mid = (tok.token_to_id(t) for t in FIM)
    parts = InfillParts("def f():\n", "\nf()\n", "  ret", [("a.py", "x = 1\n"), ("b.py", "y = 2\n")])
    ids = infill_ids(tok, fim_tokens(tok), 7, parts, max_model_len=8192, n_predict=16)
    # BOS, the repository line, each chunk after a snippet line (no file separator here), then PSM with the
    # prompt after the prefix
    extra = [tok.token_to_id("<reponame>"), *enc("myproject\n"), *enc(SNIPPET), *enc("x = 1\n"), *enc(SNIPPET),
             *enc("y = 2\n")]
    assert ids == [7, *extra, pre, *enc("def f():\n"), *enc("  ret"), suf, *enc("\nf()\n"), mid]


def test_code_spelling_special_tokens_is_text_and_the_prompt_is_not(fim_tokenizer):
    tok = fim_tokenizer
    pre, suf, mid = (tok.token_to_id(t) for t in FIM)
    parts = InfillParts("s = '<fim_middle>'\n", "<fim_prefix>", "<fim_suffix>", [("<fim_middle>.py", "<|im_end|>")])
    ids = infill_ids(tok, fim_tokens(tok), None, parts, max_model_len=8192, n_predict=16, code_tokenizer=text_only(tok))
    # one PRE and one MID, where the layout puts them; the typed prompt's spelling is a SUF before the layout's
    assert ids.count(pre) == ids.count(mid) == 1 and ids[-1] == mid and tok.token_to_id("<|im_end|>") not in ids
    assert ids.count(suf) == 2 and ids[ids.index(suf) - 1] != pre


def test_parts_are_trimmed_to_the_batch_and_the_context(fim_tokenizer):
    tok = fim_tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    prefix, suffix = " a" * 100, " b" * 100  # 100 tokens each
    assert len(enc(prefix)) == len(enc(suffix)) == 100
    parts = InfillParts(prefix, suffix, " c", [("f.py", " d" * 300)])
    ids = infill_ids(tok, fim_tokens(tok), None, parts, max_model_len=64 + 200, n_predict=10, batch=64)
    pre, suf, mid = (tok.token_to_id(t) for t in FIM)
    at_pre, at_suf = ids.index(pre), ids.index(suf)
    assert ids[at_pre + 1:at_suf] == enc(prefix)[-48:] + enc(" c")  # the prefix's last 3/4 of the batch
    assert ids[at_suf + 1:-1] == enc(suffix)[:64 // 4 - 3] and ids[-1] == mid  # 1/4 less the prompt and 2
    assert len(ids[:at_pre]) == 200 - 2 * 10  # the extra's last tokens that leave room for 2 x n_predict
    assert ids[:at_pre] == (enc(SNIPPET) + enc(" d" * 300))[-180:]
    # where llama-server's share would overrun the context, the extra gives way and the answer keeps room
    tight = infill_ids(tok, fim_tokens(tok), None, parts, max_model_len=64 + 20, n_predict=-1, batch=64)
    assert len(tight) == 64 + 20 - 1 and tight[tight.index(pre):] == ids[at_pre:]


def test_a_model_without_fim_tokens_gets_a_400(server):
    r = httpx.post(server.url + "/infill", json=BODY, timeout=60)
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"], r.text
    bad = httpx.post(server.url + "/infill", json={**BODY, "input_extra": "not a list"}, timeout=60)
    assert bad.status_code == 400 and "input_extra" in bad.text


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    """A tiny Llama of random weights whose tokenizer holds FIM tokens (the bundled one's, padded)."""
    from kvserve.config import ModelConfig
    from kvserve.model import synthetic

    config = ModelConfig("tiny-fim", vocab_size=49408, hidden_size=256, intermediate_size=512, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=4096, tie_word_embeddings=True, architecture="llama")
    spec = synthetic.SyntheticSpec("tiny-fim-q8_0", config, synthetic.QuantMix.Q8_0, control_tokens=FIM)
    return str(synthetic.build(spec, tmp_path_factory.mktemp("fim") / spec.file_name, bundled_model_path()))


@pytest.fixture(scope="module")
def fim_server(fim_model):
    from kvserve.async_engine import AsyncEngine
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from tests.server.conftest import ServerThread

    engine = AsyncEngine(LLMEngine(EngineConfig(model=fim_model, max_model_len=4096, kv_cache_memory="64MiB"))).start()
    try:
        with ServerThread(build_app(engine)) as running:
            yield running
    finally:
        engine.shutdown()


def test_infill_answers_as_completion_does(fim_server):
    whole = httpx.post(fim_server.url + "/infill", json=BODY, timeout=120)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["stop"] is True and body["tokens_predicted"] <= 4 and isinstance(body["content"], str)
    with httpx.stream("POST", fim_server.url + "/infill", json={**BODY, "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines and json.loads(lines[-1][6:])["stop"] is True


@pytest.mark.skipif(not llama_server_path().is_file(), reason="llama-server binary absent "
                    "(../shared/peers/llama.cpp/llama-server or $KVSERVE_LLAMA_SERVER)")
@pytest.mark.parametrize("size", ["small", "trimmed", "special spellings"])
def test_the_prompt_is_as_long_as_llama_servers(fim_model, fim_server, size):
    """The real llama-server on the same file and body evaluates as many prompt tokens: the same layout,
    and with a prefix and suffix past its default batch, the same trimming. (Extra chunks past the context:
    llama-server's share overruns it when every part is at its limit and it refuses the prompt, while kvserve
    trims them further; test_parts_are_trimmed_to_the_batch_and_the_context.)"""
    from kvserve.tools.bench.servers import llama_server

    body = {"small": BODY, "trimmed": {**BODY, "input_prefix": "x = 1\n" * 700, "input_suffix": "y = 2\n" * 300},
            # code that spells special tokens is text to llama-server; the typed prompt's spellings are tokens
            "special spellings": {**BODY, "input_prefix": 'END = "<|im_end|>"  # <fim_middle>\n',
                                  "prompt": "<fim_suffix>", "input_suffix": "<|im_start|>",
                                  "input_extra": [{"filename": "<|im_end|>.py", "text": "<fim_prefix>"}]}}[size]
    ours = httpx.post(fim_server.url + "/infill", json=body, timeout=120).json()
    with llama_server(llama_server_path(), fim_model, 1, 4096, 1) as peer:
        theirs = httpx.post(peer.base_url + "/infill", json=body, timeout=120).json()
    assert "tokens_evaluated" in theirs, theirs
    assert ours["tokens_evaluated"] == theirs["tokens_evaluated"], (ours, theirs)
