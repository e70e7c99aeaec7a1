"""The HTTP load generator: N concurrent streaming clients send the workload, in order, to an
OpenAI-compatible `/v1/completions` (kvserve serve or llama-server) and time each request.

Each client takes the next request as soon as its previous one finished, so at most N requests are in
flight. Per request: TTFT (first streamed chunk with a choice), end-to-end time, both from the moment
the client sent it; output tokens and cached prompt tokens as the server reports them (OpenAI `usage`,
or llama.cpp's `timings`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class HttpTarget:
    name: str
    base_url: str  # http://127.0.0.1:PORT
    model: str
    extra_body: dict = field(default_factory=dict)  # server-specific fields (ignore_eos, cache_prompt)


class HttpBenchError(RuntimeError):
    pass


def run_pass(target: HttpTarget, token_ids: list[list[int]], max_tokens: list[int], concurrency: int,
             on_tokens=None, timeout_s: float = 600.0) -> dict:
    """One pass of the workload; returns {"wall_s", "requests": [...]} in workload order."""
    return asyncio.run(_run_pass(target, token_ids, max_tokens, concurrency, on_tokens, timeout_s))


async def _run_pass(target: HttpTarget, token_ids: list[list[int]], max_tokens: list[int], concurrency: int,
                    on_tokens, timeout_s: float) -> dict:
    import httpx

    results: list[dict | None] = [None] * len(token_ids)
    next_index = iter(range(len(token_ids)))
    done_tokens = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done_tokens
        for i in next_index:  # one shared iterator: each request goes to exactly one client
            results[i] = await _one(client, target, token_ids[i], max_tokens[i])
            done_tokens += results[i]["num_output_tokens"]
            if on_tokens:
                on_tokens(done_tokens)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.monotonic() - t0
    return {"wall_s": wall, "requests": results}


async def _one(client, target: HttpTarget, ids: list[int], max_tokens: int) -> dict:
    body = {"model": target.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **target.extra_body}
    first = None
    num_chunks, text = 0, []
    usage, timings = None, None
    start = time.monotonic()
    async with client.stream("POST", f"{target.base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode("utf-8", "replace")[:300]
            raise HttpBenchError(f"{target.name} answered HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            choices = chunk.get("choices") or []
            if choices:
                first = first or time.monotonic()
                num_chunks += 1
                text.append(choices[0].get("text") or "")
    end = time.monotonic()
    if first is None:
        raise HttpBenchError(f"{target.name} streamed no tokens for a request")
    num_output, cached = token_counts(usage, timings, num_chunks)
    return {"ttft_s": first - start, "e2e_s": end - start, "num_output_tokens": num_output,
            "cached_tokens": cached, "text": "".join(text)}


def token_counts(usage: dict | None, timings: dict | None, num_chunks: int) -> tuple[int, int | None]:
    """(output tokens, cached prompt tokens): OpenAI usage first, then llama.cpp's timings; without
    either, one token per streamed chunk and the cache unknown."""
    if usage and usage.get("completion_tokens") is not None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None and timings:
            cached = timings.get("cache_n")
        return int(usage["completion_tokens"]), cached
    if timings and timings.get("predicted_n") is not None:
        return int(timings["predicted_n"]), timings.get("cache_n")
    return num_chunks, None
