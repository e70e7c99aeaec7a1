"""The shared Redis tier end to end, on a real redis-server: instances reuse each other's pages with
the same greedy outputs; prefill/decode split through `kvserve proxy`; a Redis that dies, hangs, or
holds damaged values costs misses (counted), never a wrong answer or a failed request."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import time

import pytest

from kvserve.cache.hashing import page_hashes
from kvserve.cache.redis_tier import HEADER
from tests.conftest import IDENTITY_MODES
from tests.redis_server import module_redis, redis_server  # noqa: F401

ENGINE = dict(kv_cache_memory="256MiB", max_model_len=2048, dtype="float32")
PAGE = 16
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


def cacheable(num_tokens: int) -> int:
    """Tokens a hit can cover: the full pages before the last token (always computed)."""
    return (num_tokens - 1) // PAGE * PAGE


def token_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def check_idle(llm) -> None:
    manager = llm.engine.manager
    assert not llm.engine.has_unfinished() and manager.num_used_pages == 0
    manager.check_invariants()


def wait_until_tier_usable(*llms, timeout: float = 30.0) -> None:
    """Past the tier's backoff after errors (it grows with failures in a row, up to 16 s)."""
    deadline = time.monotonic() + timeout
    while not all(llm.engine.redis_tier.available() for llm in llms):
        assert time.monotonic() < deadline, "the Redis tier stayed in backoff"
        time.sleep(0.1)


def remote_stats(llm) -> dict:
    return {k: v for k, v in llm.stats().items() if k.startswith(("remote_", "prefix_cache"))}


@pytest.fixture(scope="module", params=IDENTITY_MODES)
def pair(module_redis, request):
    """Instances A and B: separate pools, one Redis. Same process (the model weights are shared)."""
    from kvserve import LLM

    module_redis.client().flushall()  # a mode's pages are not another's (the key has the layout)
    engine = {**ENGINE, "dtype": request.param}
    a, b = LLM(redis_url=module_redis.url, **engine), LLM(redis_url=module_redis.url, **engine)
    yield a, b
    a.engine.close()
    b.engine.close()


def generate(llm, prompt, **params):
    from kvserve import SamplingParams

    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**{**GREEDY, **params}))[0]


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(role="prefill"), "add --redis-url"),
    (dict(role="middle", redis_url="redis://h:1/0"), "--role must be"),
    (dict(redis_url="http://h:1/0"), "must start with redis://"),
    (dict(redis_url="redis://h:1/0", prefix_cache="off"), "--prefix-cache radix"),
])
def test_bad_tier_settings_say_what_to_change(kwargs, message):
    from kvserve.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_cli_has_the_tier_flags():
    from kvserve.cli import build_parser

    parser = build_parser()
    serve = parser.parse_args(["serve", "--role", "decode", "--redis-url", "redis://h:1/0"])
    assert (serve.role, serve.redis_url) == ("decode", "redis://h:1/0")
    assert parser.parse_args(["generate", "hi", "--redis-url", "redis://h:1/0"]).redis_url
    proxy = parser.parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2/v1",
                               "--decode", "http://c:3", "--port", "9000"])
    assert proxy.prefill == ["http://a:1"] and len(proxy.decode) == 2 and proxy.port == 9000


def test_proxy_sends_prefill_one_token_and_no_stream():
    from kvserve.server.forwarding import prefill_body
    from kvserve.server.proxy import base_url

    body = {"prompt": "x", "max_tokens": 50, "stream": True, "n": 3,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 50}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "stream": False, "n": 1}
    assert base_url("http://h:1/v1/") == "http://h:1"


# -- two instances -------------------------------------------------------------------------------
def test_b_loads_a_pages_with_identical_outputs(pair):
    a, b = pair
    prefix = token_prompt(1, 400)
    first = generate(a, prefix + [11, 12, 13])
    assert first.num_cached_tokens == 0
    assert a.engine.redis_tier.flush(30)

    before = remote_stats(b)
    out = generate(b, prefix + [11, 12, 13])
    after = remote_stats(b)
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    assert out.num_cached_tokens == cacheable(403) == 400  # every full page of the prompt
    assert after["remote_cache_hits"] - before["remote_cache_hits"] == 400 // PAGE
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 400

    # the loaded pages are in B's own index now: the next request hits locally, no Redis query
    other = generate(b, prefix + [21, 22])
    assert other.num_cached_tokens == 400
    assert remote_stats(b)["remote_cache_queries"] == after["remote_cache_queries"]
    assert other.outputs[0].token_ids == generate(a, prefix + [21, 22]).outputs[0].token_ids
    check_idle(a)
    check_idle(b)


def test_remote_pages_extend_a_shorter_local_hit_and_feed_forks(pair):
    a, b = pair
    shared, tail = token_prompt(2, 100), token_prompt(3, 200)
    generate(b, shared + [5])  # B holds the first 6 pages locally (the 7th is partial)
    reference = generate(a, shared + tail, n=2, temperature=0.8, seed=7)
    assert a.engine.redis_tier.flush(30)
    out = generate(b, shared + tail, n=2, temperature=0.8, seed=7)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs]
    assert out.num_cached_tokens == 18 * PAGE  # 6 pages local + 12 remote (a fork parent stops
    # 2 tokens short of its prompt's end: (300 - 2) // 16 = 18 pages)
    check_idle(b)


@pytest.mark.slow
def test_two_processes_share_a_1500_token_prefix(redis_server, tmp_path, capsys):
    """Instance A (its own process) serves a 1,500-token-prefix request; instance B (another process)
    then reports the prefix as cached, with A's greedy output, and a lower TTFT."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent("""
        import json, sys
        from kvserve import LLM, SamplingParams
        job = json.loads(sys.argv[1])
        llm = LLM(redis_url=job["url"], kv_cache_memory="256MiB", max_model_len=2048, dtype="float32")
        llm.generate({"prompt_token_ids": job["warmup"]}, SamplingParams(max_tokens=2))
        out = llm.generate({"prompt_token_ids": job["prompt"]},
                           SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
        stats = llm.stats()
        llm.engine.close()  # the writer's queue reaches Redis before the process ends
        print(json.dumps({"token_ids": out.outputs[0].token_ids, "ttft_s": out.metrics.ttft_s,
                          "num_cached_tokens": out.num_cached_tokens,
                          "remote": {k: v for k, v in stats.items() if k.startswith("remote_")}}))
    """))
    prefix = token_prompt(4, 1500)
    prompt = prefix + token_prompt(5, 20)

    def run(warmup_seed: int) -> dict:
        # a read timeout for a loaded host: B's lookup reads ~70 MB of float32 pages, and the tier's
        # default 0.25 s (fail fast, serve without Redis) ran out once under a loaded suite
        job = {"url": redis_server.url + "?socket_timeout=5", "prompt": prompt,
               "warmup": token_prompt(warmup_seed, 64)}
        done = subprocess.run([sys.executable, str(worker), json.dumps(job)], capture_output=True,
                              text=True, timeout=900, cwd=str(tmp_path))
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    a = run(100)
    b = run(101)
    assert a["num_cached_tokens"] == 0 and a["remote"]["remote_cache_writes"] >= 1500 // PAGE, a
    assert b["token_ids"] == a["token_ids"]
    assert b["num_cached_tokens"] >= 0.9 * len(prefix), b
    assert b["remote"]["remote_cache_hits"] >= cacheable(len(prompt)) // PAGE
    ratio = a["ttft_s"] / b["ttft_s"]
    with capsys.disabled():
        print(f"\nTTFT 1,520-token prompt: cold {a['ttft_s']:.2f} s, remote-warm {b['ttft_s']:.2f} s "
              f"(cold / warm = {ratio:.1f}x); B cached {b['num_cached_tokens']} tokens")
    assert b["ttft_s"] < a["ttft_s"]


# -- prefill / decode split ----------------------------------------------------------------------
@pytest.mark.slow
def test_prefill_decode_split_through_the_proxy_matches_one_instance(pair, redis_server):
    from openai import OpenAI

    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from kvserve.server.proxy import build_proxy_app
    from tests.server.conftest import ServerThread

    single = pair[0]  # a plain instance with the same engine settings (its own Redis)
    engine = {**ENGINE, "dtype": single.engine.config.dtype}  # the pair's weight mode
    prefill = LLMEngine(EngineConfig(redis_url=redis_server.url, role="prefill", **engine))
    decode = LLMEngine(EngineConfig(redis_url=redis_server.url, role="decode", **engine))
    prompt = token_prompt(6, 300)
    text = "Explain in one sentence why the sky is blue. " * 6
    with ServerThread(build_app(prefill)) as p, ServerThread(build_app(decode)) as d, \
            ServerThread(build_proxy_app([p.url], [d.url + "/v1"])) as proxy:
        client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        out = client.completions.create(model=_model(client), prompt=prompt, max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == generate(single, prompt).outputs[0].text
        assert out.usage.prompt_tokens_details.cached_tokens == cacheable(300)  # loaded

        chunks = client.completions.create(model=_model(client), prompt=text, max_tokens=12,
                                           temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        from kvserve import SamplingParams
        assert streamed == single.generate(text, SamplingParams(max_tokens=12))[0].outputs[0].text

        messages = [{"role": "user", "content": text}]
        chat = client.chat.completions.create(model=_model(client), messages=messages,
                                              max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == single.chat(
            messages, SamplingParams(max_tokens=12))[0].outputs[0].text
        assert chat.usage.prompt_tokens_details.cached_tokens == cacheable(chat.usage.prompt_tokens)

        stats = decode.stats().as_dict()
        assert stats["remote_cache_hits"] >= 300 // PAGE and stats["remote_cache_errors"] == 0
        assert prefill.stats().as_dict()["generation_tokens"] == 3  # one token per request, then done
    prefill.close()
    decode.close()


@pytest.mark.slow
def test_kvserve_serve_roles_and_kvserve_proxy_as_commands(pair, redis_server, tmp_path):
    """The same split as users start it: three processes."""
    import httpx
    from openai import OpenAI

    from kvserve import SamplingParams
    from tests.redis_server import free_port

    ports = [free_port() for _ in range(3)]
    engine = ["--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--dtype", pair[0].engine.config.dtype,
              "--log-level", "warning"]
    commands = [
        ["serve", "--role", "prefill", "--redis-url", redis_server.url, "--port", str(ports[0]),
         *engine],
        ["serve", "--role", "decode", "--redis-url", redis_server.url, "--port", str(ports[1]),
         *engine],
        ["proxy", "--prefill", f"http://127.0.0.1:{ports[0]}", "--decode",
         f"http://127.0.0.1:{ports[1]}", "--port", str(ports[2]), "--log-level", "warning"],
    ]
    logs = [open(tmp_path / f"{i}.log", "w+") for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-m", "kvserve.cli", *c], stdout=log,
                              stderr=subprocess.STDOUT) for c, log in zip(commands, logs)]
    proxy = f"http://127.0.0.1:{ports[2]}"
    try:
        deadline = time.monotonic() + 300
        while True:  # the proxy's /health is 200 once both instances answer theirs
            assert all(p.poll() is None for p in procs), [
                (tmp_path / f"{i}.log").read_text()[-2000:] for i in range(3)]
            try:
                if httpx.get(proxy + "/health", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the split did not come up"
            time.sleep(0.5)
        client = OpenAI(base_url=proxy + "/v1", api_key="unused", timeout=600, max_retries=0)
        text = "A short story about a lighthouse keeper and the storm. " * 8
        out = client.completions.create(model=_model(client), prompt=text, max_tokens=10,
                                        temperature=0)
        expected = pair[0].generate(text, SamplingParams(max_tokens=10))[0]
        assert out.choices[0].text == expected.outputs[0].text
        assert out.usage.prompt_tokens_details.cached_tokens == cacheable(out.usage.prompt_tokens)
    finally:
        for proc in procs:
            proc.terminate()
        for proc, log in zip(procs, logs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def _model(client) -> str:
    return client.models.list().data[0].id


# -- faults --------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_pages_are_detected_and_recomputed(pair, module_redis, damage):
    a, b = pair
    prompt = token_prompt({"flip": 7, "truncate": 8, "header": 9}[damage], 200)
    reference = generate(a, prompt)
    assert a.engine.redis_tier.flush(30)
    key = b.engine.redis_tier.key(page_hashes(prompt, PAGE, "")[3])
    client = module_redis.client()
    value = bytearray(client.get(key))
    if damage == "flip":
        value[HEADER.size + len(value) // 2] ^= 0x10
    elif damage == "truncate":
        value = value[:len(value) // 2]
    else:
        value[:4] = b"JUNK"
    client.set(key, bytes(value))

    errors = b.stats()["remote_cache_errors"]
    out = generate(b, prompt)
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert out.num_cached_tokens == 3 * PAGE  # pages 0-2 from Redis, 3 onwards recomputed
    assert b.stats()["remote_cache_errors"] == errors + 1
    assert b.engine.redis_tier.flush(30)  # B wrote its own page 3 over the damaged value
    assert b.engine.redis_tier.get(page_hashes(prompt, PAGE, "")[3]) is not None
    check_idle(b)


def test_a_hung_redis_costs_one_timeout_then_requests_run_without_it(pair, module_redis):
    """Three requests admitted in one step while Redis hangs: the first query times out, the other
    two skip the tier (backoff) instead of waiting for their own timeouts."""
    from kvserve import SamplingParams

    a, b = pair
    prompts = [token_prompt(seed, 120) for seed in (10, 11, 12)]
    reference = [generate(a, p) for p in prompts]
    assert a.engine.redis_tier.flush(30)
    before = remote_stats(b)
    module_redis.pause()
    try:
        ids = [b.engine.add_request({"prompt_token_ids": p}, SamplingParams(**GREEDY))
               for p in prompts]
        finished = {}
        while len(finished) < len(ids):
            finished.update((o.request_id, o) for o in b.engine.step() if o.finished)
    finally:
        module_redis.resume()
    outs = [finished[i] for i in ids]
    after = remote_stats(b)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert after["remote_cache_errors"] > before["remote_cache_errors"]
    assert after["remote_cache_skipped"] - before["remote_cache_skipped"] >= 2
    wait_until_tier_usable(a, b)  # later tests find the tier working
    check_idle(b)


@pytest.mark.slow
def test_killing_redis_mid_load_then_it_comes_back(pair, module_redis):
    """Every request completes with the right tokens while Redis dies under a load; errors are
    counted; when redis-server restarts on the same port the tier reconnects and hits again."""
    from kvserve import SamplingParams

    a, b = pair
    wait_until_tier_usable(a, b)
    prompts = [token_prompt(seed, 160) for seed in range(20, 26)]
    reference = [generate(a, p) for p in prompts]
    assert a.engine.redis_tier.flush(30)
    errors = b.stats()["remote_cache_errors"]

    engine = b.engine
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(**GREEDY)) for p in prompts[:3]]
    finished: dict = {}
    steps = 0
    while len(finished) < len(prompts):
        steps += 1
        if steps == 3:
            module_redis.kill()  # mid-load: some requests running, some waiting or not yet sent
        if steps == 5:
            ids += [engine.add_request({"prompt_token_ids": p}, SamplingParams(**GREEDY))
                    for p in prompts[3:]]
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    outs = [finished[i] for i in ids]
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    assert any(o.num_cached_tokens > 0 for o in outs[:3])  # before the kill: remote hits
    assert all(o.num_cached_tokens == 0 for o in outs[3:])  # after it: computed here
    assert b.stats()["remote_cache_errors"] > errors
    check_idle(b)

    module_redis.start()  # same port, empty
    wait_until_tier_usable(a, b)
    fresh = token_prompt(30, 160)
    expected = generate(a, fresh)  # A publishes to the restarted Redis
    assert a.engine.redis_tier.flush(30)
    hits = b.stats()["remote_cache_hits"]
    out = generate(b, fresh)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.num_cached_tokens == cacheable(160)
    assert b.stats()["remote_cache_hits"] - hits == cacheable(160) // PAGE
    check_idle(b)


# -- an authenticated tier (issue 18) ------------------------------------------------------------
@pytest.mark.slow
def test_forged_pages_are_rejected_with_a_secret(module_redis, monkeypatch):
    """The attack of issue 18: copy the pages of one prompt onto the keys of another. With a shared
    secret the names are keyed hashes (the attacker is given them here, as if leaked) and each
    value's MAC binds it to its key: B rejects every forged page (counted), recomputes, and answers
    exactly as A did."""
    from kvserve import LLM

    monkeypatch.setenv("KVSERVE_KV_TIER_SECRET", "issue-18 test secret, 32 bytes..")
    a, b = LLM(redis_url=module_redis.url, **ENGINE), LLM(redis_url=module_redis.url, **ENGINE)
    try:
        tier_a, tier_b = a.engine.redis_tier, b.engine.redis_tier
        assert tier_a.auth.enabled and tier_b.auth.enabled
        red, green = token_prompt(181, 160), token_prompt(182, 160)
        generate(a, red)
        reference = generate(a, green)
        assert tier_a.flush(30)
        client = module_redis.client()
        red_keys = [tier_a.key(h) for h in page_hashes(red, PAGE, "")[:9]]
        green_keys = [tier_a.key(h) for h in page_hashes(green, PAGE, "")[:9]]
        assert all(client.exists(k) for k in red_keys + green_keys)
        assert not any(h.hex() in k for h, k in zip(page_hashes(green, PAGE, ""), green_keys))
        for red_key, green_key in zip(red_keys, green_keys):
            client.set(green_key, client.get(red_key))
        # the unkeyed names of the old scheme: planted pages nobody reads
        for h, red_key in zip(page_hashes(green, PAGE, ""), red_keys):
            client.set(tier_a.prefix + h.hex(), client.get(red_key))

        errors = b.stats()["remote_cache_errors"]
        out = generate(b, green)
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert out.num_cached_tokens == 0  # the first page failed verification: all recomputed
        assert b.stats()["remote_cache_errors"] == errors + 1
        check_idle(b)
    finally:
        a.engine.close()
        b.engine.close()


def test_without_a_secret_the_tier_trusts_every_writer(pair, module_redis):
    """The threat the secret removes: unkeyed names are predictable and CRC32 is no MAC, so pages
    copied onto another prompt's keys are taken as that prompt's (no error counted)."""
    a, b = pair
    assert not a.engine.redis_tier.auth.enabled
    red, green = token_prompt(183, 160), token_prompt(184, 160)
    generate(a, red)
    assert a.engine.redis_tier.flush(30)
    client = module_redis.client()
    for red_hash, green_hash in zip(page_hashes(red, PAGE, "")[:9], page_hashes(green, PAGE, "")):
        forged_key = a.engine.redis_tier.prefix + green_hash.hex()  # anyone can compute it
        client.set(forged_key, client.get(a.engine.redis_tier.key(red_hash)))
    errors = b.stats()["remote_cache_errors"]
    out = generate(b, green)
    assert out.num_cached_tokens == 9 * PAGE  # the forged pages were used
    assert b.stats()["remote_cache_errors"] == errors
    check_idle(b)
