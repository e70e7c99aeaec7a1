"""`--chat-template FILE|STRING` (vLLM's flag): it replaces the model's template for what the model sees
(the render route shows a tools-aware template's own tool block instead of the generic format), on
`kvserve serve` as a user starts it and on `LLM(...)`; a value that is neither a file nor a template is
refused at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from kvserve.config import ConfigError
from kvserve.model.generic_tools import GENERIC_TOOLS_PREAMBLE
from kvserve.model.gguf_loader import bundled_model_path, load_gguf
from tests.conftest import make_llm
from tests.redis_server import free_port
from tests.server.conftest import stop_serving, wait_until_serving
from tests.server.test_tools import WEATHER
from tests.server.tool_templates import QWEN25_TEMPLATE

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_llm_chat_template_file_and_string_replace_the_models(tmp_path):
    path = tmp_path / "qwen.jinja"
    path.write_text(QWEN25_TEMPLATE)
    own = make_llm(kv_cache_memory="64MiB", max_model_len=512).engine.chat_prompt(ASK, [WEATHER])
    assert GENERIC_TOOLS_PREAMBLE in own and "<tools>" not in own
    for value in (str(path), QWEN25_TEMPLATE):
        llm = make_llm(kv_cache_memory="64MiB", max_model_len=512, chat_template=value)
        text = llm.engine.chat_prompt(ASK, [WEATHER])
        assert "<tools>\n" in text and '"name": "get_weather"' in text and GENERIC_TOOLS_PREAMBLE not in text
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        make_llm(kv_cache_memory="64MiB", max_model_len=512, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="does not compile"):
        make_llm(kv_cache_memory="64MiB", max_model_len=512, chat_template="{% for %}")


@pytest.mark.slow
def test_kvserve_serve_with_chat_template_renders_it_and_calls_in_its_format(tmp_path):
    template = tmp_path / "qwen.jinja"
    template.write_text(QWEN25_TEMPLATE)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--kv-cache-memory", "128MiB",
         "--max-model-len", "1024", "--chat-template", str(template), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until_serving(proc, url, tmp_path / "serve.log")
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        rendered = httpx.post(url + "/v1/chat/completions/render", timeout=60,
                              json={"model": model, "messages": ASK, "tools": [WEATHER]}).json()
        text = load_gguf(bundled_model_path()).tokenizer.decode(rendered["token_ids"], skip_special_tokens=False)
        assert "<tools>\n" in text and GENERIC_TOOLS_PREAMBLE not in text
        out = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                             temperature=0, max_tokens=60)
        assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    finally:
        stop_serving(proc)
        log.close()
