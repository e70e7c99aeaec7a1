"""`kvserve serve` as a user starts it: a subprocess on a free loopback port with an API key, that
answers the openai client and stops on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from tests.redis_server import free_port
from tests.server.conftest import wait_until_serving


@pytest.mark.slow
def test_kvserve_serve_answers_and_stops(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--api-key", "sk-test",
         "--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--served-model-name", "smol",
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until_serving(proc, url, tmp_path / "serve.log")
        client = OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smol"]
        out = client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens >= 1
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=30) in (0, 130, -signal.SIGINT)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()


def test_api_keys_from_flag_file_and_environment(tmp_path, monkeypatch):
    import argparse

    from kvserve.server.launch import load_api_keys

    keys = tmp_path / "keys"
    keys.write_text("# comment\nsk-file-1\n\n  sk-file-2  \n")
    monkeypatch.setenv("KVSERVE_API_KEYS", "sk-env-1, sk-env-2 sk-file-1")
    args = argparse.Namespace(api_key=["sk-flag"], api_key_file=str(keys))
    assert load_api_keys(args) == ["sk-flag", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2"]
    keys.write_text("# only a comment\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(args)
    with pytest.raises(ValueError, match="cannot read --api-key-file"):
        load_api_keys(argparse.Namespace(api_key=None, api_key_file=str(tmp_path / "missing")))


def test_plan_prints_the_memory_promise_from_the_same_function(capsys):
    from kvserve.cli import main
    from kvserve.config import parse_bytes
    from kvserve.memory_promise import memory_promise
    from kvserve.tools.planner import run_plan
    from kvserve.cli import build_parser

    argv = ["plan", "--model", "smollm2-135m", "--context", "2048", "--kv-cache-memory", "1GiB"]
    assert main(argv) == 0
    result = run_plan(build_parser().parse_args(argv))
    line = memory_promise(result["model"]["weights_bytes"], parse_bytes("1GiB"),
                          parse_bytes("2GiB")).line()
    assert line in capsys.readouterr().out
    assert line.startswith("memory: weights ") and "KV pool 1 GiB" in line and "host tier" in line



def test_the_memory_line_counts_the_packed_weights_without_making_a_float_copy():
    """Counting the weights for the start-up line once dequantized the whole model (513 MiB of float32
    for the bundled 98 MB GGUF), and the memoized loader kept that copy for the life of the server. A
    fresh process: the suite's float32 engines share the loader's copy in this one."""
    import json
    import subprocess
    import sys

    script = (
        "import json, os\n"
        "from kvserve.config import EngineConfig, resolve_model_dtype\n"
        "from kvserve.engine import LLMEngine\n"
        "from kvserve.server.launch import weights_bytes\n"
        "e = LLMEngine(EngineConfig(kv_cache_memory='16MiB', max_model_len=512))\n"
        "n = weights_bytes(e)\n"
        "print(json.dumps({'counted': n, 'file': os.path.getsize(e.loaded.path),\n"
        "                  'dtype': resolve_model_dtype(e.config.dtype, 'cpu'),\n"
        "                  'float_copy': len(e.loaded.held_weights())}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["float_copy"] == 0, result
    if result["dtype"] == "native":  # the GGUF's own blocks: about the file's bytes
        assert result["counted"] <= result["file"] * 1.05, result
