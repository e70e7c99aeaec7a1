"""Traces: request streams for the simulator and the benchmarks, loaded from JSON lines or generated.

A trace line (DESIGN.md §4) holds `prompt_token_ids` (ints) or `prompt` (text) and optionally `id`,
`arrival` (seconds), `max_tokens`, `session`, `cache_salt` and `tenant` (together the namespace, as
`cache.hashing.namespace` builds it for the server) and `cache_breakpoints` (`[{"num_tokens": N,
"ttl_s": S}, ...]`: the request's `cache_control` breakpoints, leased as the server leases them). Closed loops
(an agent waiting on its tool, a user thinking): `after` (an earlier line's id: this one is sent `delay_s`
seconds after that one finishes, and has no `arrival`), `continues: true` (its prompt is that request's
prompt, then its output, then this line's tokens: a conversation resent with one more turn) and
`tool_call: true` (its answer is a tool call: forced by a grammar in the bench, ended by an end-of-turn
token in the simulator, and its KV held while the tool runs when retention is on). `generate_trace` builds
deterministic synthetic mixes, in token ids drawn from the bundled model's vocabulary, each shaped like
a workload whose prefix-cache behaviour is well known:

    w1         one shared system prompt + a distinct question (like ../shared/workloads/w1.jsonl)
    agent      tool loops, closed: system prompt + ~4k tokens of tool definitions (identical on every
               call) + a task; each answer a tool call, each follow-up the conversation + the call +
               the tool's result, sent a tool latency (lognormal) after the answer; beside them, other
               users' unrelated requests (closed loops with think times) that keep the pool churning
    agent-small  the agent trace sized for `kvserve bench` on 2 cores (1k tokens of system prompt and
               tools, 3 calls a session, ~40 s tools, one other user; tools/agent_trace.py)
    agent-steps  open loop: system prompt + one of a few tool-definition variants + a task, then steps
               that append a tool call and its result (each step resends everything before it)
    multiturn  sessions of 6 turns, each resending the whole history and the previous answer
    rag        system prompt + one of K documents (skewed popularity) + a question
    midprompt  a per-request header BEFORE a long shared system prompt: the classic mistake that
               hides the shared part from every prefix cache

Text prompts are tokenized by `encode_prompts`: with the bundled model's tokenizer (`tokenizer=
"bundled"`, or a .gguf path), or with `tokenizer="none"`: one token per UTF-8 byte (ids 0..255), which
keeps shared text shared without loading anything (hit rates are then in bytes, not model tokens).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from kvserve.config import ConfigError
from kvserve.tools.agent_trace import agent_trace, small_agent_trace
from kvserve.tools.trace_line import VOCAB_HIGH, VOCAB_LOW, TraceRequest, synthetic_tokens

__all__ = ["GENERATORS", "VOCAB_HIGH", "VOCAB_LOW", "TraceRequest", "check_loops", "encode_prompts", "generate_trace",
           "has_loops", "load_trace", "write_trace"]

# -- loading ---------------------------------------------------------------------------------------
def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSON-lines trace; a malformed line is a ConfigError naming the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"trace {path} is not UTF-8 text (expected JSON lines)") from None
    requests = [_parse_line(line, f"{path}:{number}", number)
                for number, line in enumerate(lines, 1) if line.strip()]
    if not requests:
        raise ConfigError(f"trace {path} has no requests (expected one JSON object per line)")
    check_loops(requests, str(path))
    return requests


def check_loops(requests: list[TraceRequest], where: str) -> None:
    """Every `after` names an earlier request (so any prefix of a trace is a trace), ids are unique."""
    seen: set[str] = set()
    for r in requests:
        if r.after is not None and r.after not in seen:
            raise ConfigError(f"{where}: request {r.id!r} comes after {r.after!r}, which is not an earlier "
                              "request of the trace")
        if r.id in seen:
            raise ConfigError(f"{where}: request id {r.id!r} appears twice")
        seen.add(r.id)


def has_loops(requests: list[TraceRequest]) -> bool:
    return any(r.after is not None for r in requests)


def _parse_line(line: str, where: str, number: int) -> TraceRequest:
    try:
        obj = json.loads(line)
    except ValueError:
        raise ConfigError(f"{where}: not valid JSON") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object with prompt_token_ids or prompt")
    ids, text = obj.get("prompt_token_ids"), obj.get("prompt")
    if (ids is None) == (text is None):
        raise ConfigError(f"{where}: give exactly one of prompt_token_ids (list of ints) or prompt (text)")
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ConfigError(f"{where}: prompt_token_ids must be a non-empty list of non-negative ints")
    if text is not None and (not isinstance(text, str) or not text):
        raise ConfigError(f"{where}: prompt must be non-empty text")
    arrival, max_tokens = obj.get("arrival"), obj.get("max_tokens")
    if arrival is not None and (not _is_number(arrival) or arrival < 0 or not math.isfinite(arrival)):
        raise ConfigError(f"{where}: arrival must be seconds >= 0, got {arrival!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0):
        raise ConfigError(f"{where}: max_tokens must be an int >= 0, got {max_tokens!r}")
    session, salt, tenant = obj.get("session"), obj.get("cache_salt"), obj.get("tenant")
    for key, value in (("cache_salt", salt), ("tenant", tenant)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a string")
    after, delay, continues, tool_call = (obj.get(k) for k in ("after", "delay_s", "continues", "tool_call"))
    if after is not None and (not isinstance(after, str) or arrival is not None):
        raise ConfigError(f"{where}: after is the id (a string) of an earlier request, and such a line has no "
                          "arrival (it is sent delay_s after that request finishes)")
    if delay is not None and (after is None or not _is_number(delay) or delay < 0 or not math.isfinite(delay)):
        raise ConfigError(f"{where}: delay_s must be seconds >= 0, on a line with after, got {delay!r}")
    for key, value in (("continues", continues), ("tool_call", tool_call)):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false")
    if continues and after is None:
        raise ConfigError(f"{where}: continues needs after (the request whose conversation it continues)")
    return TraceRequest(id=str(obj.get("id", f"line-{number}")), prompt_token_ids=ids, prompt=text,
                        arrival=None if arrival is None else float(arrival), max_tokens=max_tokens,
                        session=None if session is None else str(session), cache_salt=salt, tenant=tenant,
                        cache_breakpoints=_parse_breakpoints(obj.get("cache_breakpoints"), where),
                        after=after, delay_s=None if after is None else float(delay or 0.0),
                        continues=bool(continues), tool_call=bool(tool_call))


def _parse_breakpoints(value, where: str) -> list[tuple[int, float]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ConfigError(f"{where}: cache_breakpoints must be a list of {{num_tokens, ttl_s}} objects")
    found = []
    for item in value:
        n = item.get("num_tokens") if isinstance(item, dict) else None
        ttl = item.get("ttl_s", 300.0) if isinstance(item, dict) else None
        if (not isinstance(n, int) or isinstance(n, bool) or n < 1 or not _is_number(ttl) or ttl <= 0
                or not math.isfinite(ttl)):
            raise ConfigError(f"{where}: each cache breakpoint is {{\"num_tokens\": int >= 1, "
                              f"\"ttl_s\": seconds > 0}}, got {item!r}")
        found.append((n, float(ttl)))
    return found


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def write_trace(requests: list[TraceRequest], path: str | Path) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            for request in requests:
                f.write(json.dumps(request.to_json(), separators=(",", ":")) + "\n")
    except OSError as exc:
        raise ConfigError(f"cannot write trace {path}: {exc.strerror or exc}") from None


def encode_prompts(requests: list[TraceRequest], tokenizer: str = "bundled") -> list[list[int]]:
    """Token ids of every request. `tokenizer` matters only for text prompts: "bundled" (SmolLM2's
    tokenizer, as the engine encodes), a .gguf path, or "none" (one token per UTF-8 byte)."""
    encode = None
    out = []
    for request in requests:
        if request.prompt_token_ids is not None:
            out.append(list(request.prompt_token_ids))
            continue
        if encode is None:
            encode = _text_encoder(tokenizer)
        ids = encode(request.prompt)
        if not ids:
            raise ConfigError(f"request {request.id}: the prompt encodes to no tokens")
        out.append(ids)
    return out


def _text_encoder(tokenizer: str):
    if tokenizer == "none":
        return lambda text: list(text.encode("utf-8"))
    # Only the tokenizer is built (from the GGUF metadata), not the weights. gguf_loader imports torch:
    # that cost is paid only for text traces with a model tokenizer.
    from kvserve.model.gguf_loader import bundled_model_path, resolve_model_path

    path = bundled_model_path() if tokenizer == "bundled" else resolve_model_path(tokenizer)
    return _gguf_encoder(path)


def _gguf_encoder(path: str):
    from kvserve.model.gguf_config import read_gguf
    from kvserve.model.tokenizer import build_tokenizer

    meta = {k: v for k, v in read_gguf(path).fields.items() if k.startswith(("tokenizer.", "general."))}
    tok = build_tokenizer(meta)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))  # as LoadedModel.encode does
    return lambda text: tok.encode(text, add_special_tokens=add_bos).ids


# -- generators ------------------------------------------------------------------------------------
_tokens = synthetic_tokens


def _finish(name: str, drafts: list[tuple[float, list[int], int, str | None]], n: int) -> list[TraceRequest]:
    """Sort drafts (arrival, tokens, max_tokens, session) by arrival, keep n, name them in order."""
    drafts.sort(key=lambda d: d[0])
    return [TraceRequest(f"{name}-{i:04d}", tokens, None, round(arrival, 3), max_tokens, session)
            for i, (arrival, tokens, max_tokens, session) in enumerate(drafts[:n])]


def _w1(rng: random.Random, n: int) -> list[TraceRequest]:
    system = _tokens(rng, 1497)
    return _finish("w1", [(0.0, system + _tokens(rng, rng.randint(45, 63)), 64, None) for _ in range(n)], n)


def _agent_steps(rng: random.Random, n: int) -> list[TraceRequest]:
    system = _tokens(rng, 1200)
    tool_sets = [_tokens(rng, rng.randint(400, 800)) for _ in range(3)]
    drafts, start, s = [], 0.0, 0
    while len(drafts) < n:
        start += rng.expovariate(1 / 3.0)
        tools = tool_sets[rng.choices(range(3), weights=(5, 3, 2))[0]]
        history, t = system + tools + _tokens(rng, rng.randint(50, 150)), start
        for _ in range(rng.randint(2, 6)):
            drafts.append((t, list(history), 48, f"agent-s{s}"))
            # the model's tool call, then the tool's result, appended to everything sent before
            history += _tokens(rng, rng.randint(20, 48)) + _tokens(rng, rng.randint(100, 400))
            t += rng.uniform(2.0, 6.0)
        s += 1
    return _finish("agent-steps", drafts, n)


def _multiturn(rng: random.Random, n: int) -> list[TraceRequest]:
    system = _tokens(rng, 120)
    drafts, start, s = [], 0.0, 0
    while len(drafts) < n:
        start += rng.expovariate(1 / 4.0)
        history, t = list(system), start
        for _ in range(6):
            history += _tokens(rng, rng.randint(20, 80))  # the user's turn
            answer = rng.randint(40, 160)
            drafts.append((t, list(history), answer, f"chat-s{s}"))
            history += _tokens(rng, answer)  # the previous answer is resent next turn
            t += rng.uniform(8.0, 30.0)
        s += 1
    return _finish("multiturn", drafts, n)


def _rag(rng: random.Random, n: int) -> list[TraceRequest]:
    system = _tokens(rng, 300)
    documents = [_tokens(rng, rng.randint(600, 1200)) for _ in range(8)]
    weights = [1 / (k + 1) ** 1.2 for k in range(len(documents))]  # Zipf-like popularity
    drafts, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1 / 1.0)
        document = documents[rng.choices(range(len(documents)), weights=weights)[0]]
        drafts.append((t, system + document + _tokens(rng, rng.randint(20, 60)), 64, None))
    return _finish("rag", drafts, n)


MIDPROMPT_HEADER_TOKENS = 8
MIDPROMPT_SYSTEM_TOKENS = 1500


def _midprompt(rng: random.Random, n: int) -> list[TraceRequest]:
    header_start = _tokens(rng, 2)  # e.g. "[request" ... then the per-request id and timestamp
    system = _tokens(rng, MIDPROMPT_SYSTEM_TOKENS)
    drafts, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1 / 1.0)
        header = header_start + _tokens(rng, MIDPROMPT_HEADER_TOKENS - 2)
        drafts.append((t, header + system + _tokens(rng, rng.randint(30, 60)), 64, None))
    return _finish("midprompt", drafts, n)


GENERATORS = {"w1": _w1, "agent": agent_trace, "agent-small": small_agent_trace, "agent-steps": _agent_steps,
              "multiturn": _multiturn, "rag": _rag, "midprompt": _midprompt}


def generate_trace(name: str, n: int = 64, seed: int = 0) -> list[TraceRequest]:
    """`n` requests of the named mix, sorted by arrival; the same (name, n, seed) gives the same trace."""
    if name not in GENERATORS:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(GENERATORS)}")
    if n < 1:
        raise ConfigError(f"the number of requests must be >= 1, got {n}")
    return GENERATORS[name](random.Random(f"{name}:{seed}"), n)
