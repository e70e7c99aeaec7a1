"""OpenAI's prompt caching fields: `prompt_cache_key` is taken on every route (a routing hint, never
an isolation boundary: two keys share the prefix), `prompt_cache_retention: "24h"` is capped to
in_memory, and said so, on a server without a disk or Redis tier, and with `--kv-disk-path` a 24h prefix
is still cached after unpinned prefixes overflowed the disk tier and `kvserve serve` restarted, with the
greedy text of the cold run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from openai import OpenAI

from tests.redis_server import free_port
from tests.server.conftest import stop_serving, wait_until_serving

PREFIX = ("You are the archivist of a small museum. The collection holds maps, coins, letters and "
          "a clock that stopped in 1911. Answer in one short sentence. ") * 2


def test_24h_without_a_tier_is_capped_and_said(client, model_name):
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body={"prompt_cache_retention": "24h"})
    assert chat.model_extra["prompt_cache_retention"] == "in_memory"
    assert "no disk or Redis" in chat.model_extra["prompt_cache_retention_note"]
    text = client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                     extra_body={"prompt_cache_retention": "in_memory"})
    assert text.model_extra["prompt_cache_retention"] == "in_memory"
    resp = client.responses.create(model=model_name, input="Hi", max_output_tokens=2, store=False,
                                   prompt_cache_retention="24h")
    assert resp.prompt_cache_retention == "in_memory"


def test_prompt_cache_key_is_a_hint_not_a_namespace(client, model_name):
    messages = [{"role": "system", "content": PREFIX}, {"role": "user", "content": "What stopped?"}]
    client.chat.completions.create(model=model_name, messages=messages, max_tokens=2, prompt_cache_key="one")
    other = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2,
                                           prompt_cache_key="two")
    assert other.usage.prompt_tokens_details.cached_tokens >= 32


PAGE_FILE = 368_640 + 88  # a bf16 page of the bundled model (16 tokens x 23,040 bytes) + its file header
DISK_PAGES = 24
FILLERS = [" ".join(f"{word}{k}" for word in ("lantern", "harbor", "copper", "meadow") * 40)
           for k in range(3)]  # ~3 x 19 pages: the 24-page disk tier overflows twice


def serve(tmp_path, port: int, disk: str, name: str) -> subprocess.Popen:
    log = open(tmp_path / name, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--kv-cache-memory", "128MiB",
         "--max-model-len", "1024", "--kv-disk-path", disk, "--log-level", "warning",
         "--kv-disk-bytes", str(DISK_PAGES * PAGE_FILE), "--kv-pin-tenant-bytes", str(12 * PAGE_FILE)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_until_serving(proc, f"http://127.0.0.1:{port}", tmp_path / name)
    return proc


@pytest.mark.slow
def test_24h_on_a_disk_tier_survives_a_restart(tmp_path):
    disk, port = str(tmp_path / "kv"), free_port()
    messages = [{"role": "system", "content": PREFIX}, {"role": "user", "content": "What stopped?"}]
    outputs, responses = [], []
    for run in range(2):
        proc = serve(tmp_path, port, disk, f"serve{run}.log")
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            if run == 1:  # first, the next turn: the first answer's pages were pinned with its prompt
                answer = {"role": "assistant", "content": outputs[0].choices[0].message.content}
                follow = client.chat.completions.create(
                    model=model, messages=[*messages, answer, {"role": "user", "content": "And the coins?"}],
                    max_tokens=4, temperature=0, extra_body={"prompt_cache_retention": "24h"})
            outputs.append(client.chat.completions.create(
                model=model, messages=messages, max_tokens=12, temperature=0,
                extra_body={"prompt_cache_retention": "24h"}))
            responses.append(client.responses.create(model=model, input=messages[1:], instructions=PREFIX,
                                                      max_output_tokens=12, temperature=0,
                                                      prompt_cache_retention="24h"))
            for filler in FILLERS if run == 0 else ():  # unpinned prefixes push the disk tier's LRU
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": filler}],
                                               max_tokens=1)
        finally:
            stop_serving(proc)
    cold, warm = outputs
    turn = cold.usage.prompt_tokens + cold.usage.completion_tokens - 1  # (the last token has no KV)
    assert follow.usage.prompt_tokens_details.cached_tokens >= turn // 16 * 16 - 16
    assert follow.usage.prompt_tokens_details.cached_tokens > cold.usage.prompt_tokens // 16 * 16
    assert len(list((tmp_path / "kv").glob("*/*/*.kvp"))) <= DISK_PAGES  # the budget held: others went
    # the Responses API's own turn after the restart: its prompt is the chat's, so it hits the disk too
    assert responses[1].usage.input_tokens_details.cached_tokens >= responses[1].usage.input_tokens // 16 * 16 - 16
    assert responses[1].output_text == responses[0].output_text == cold.choices[0].message.content
    assert responses[1].prompt_cache_retention == "24h"
    assert cold.model_extra["prompt_cache_retention"] == "24h"
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens // 16 * 16 - 16
    assert warm.choices[0].message.content == cold.choices[0].message.content
